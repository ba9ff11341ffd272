"""Command-line tools: the ``kvcodec`` CLI, the demo (main job), V-quality reports, kernel audit and tuning."""
