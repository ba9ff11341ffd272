"""kvcodec for LMCache: a drop-in ``lmcache.v1.kv_codec`` (:mod:`.compat`) and a serde for its storage."""
