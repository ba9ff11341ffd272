"""Greedy tokens of two engines compared as the engine tests do: up to each prompt's first near-tie.

V is stored in FP8, so a loaded engine's log-probabilities move by a few hundredths of a nat; the
tiny random model has near-ties where that can flip a greedy choice.
"""

from __future__ import annotations

__all__ = ["MIN_COMPARED", "same_greedy"]

TIE = 0.1
"""Baseline top-2 log-probability gap (nats) below which a greedy choice counts as a near-tie."""
MAX_DRIFT = 0.1
"""Largest change of the top log-probability allowed at compared positions."""
MIN_COMPARED = 0.5
"""Least share of all generated positions that must be clear of near-ties (and so compared)."""


def same_greedy(base: list[dict], got: list[dict]) -> int:
    """Assert ``got``'s outputs generate ``base``'s tokens up to each prompt's first near-tie; return
    the positions compared (callers check it against ``MIN_COMPARED``)."""
    assert len(base) == len(got)
    compared = 0
    for i, (b, g) in enumerate(zip(base, got)):
        for pos, (tok, top2, gtop2) in enumerate(zip(b["tokens"], b["top2"], g["top2"])):
            if top2[0] - top2[1] < TIE:
                break
            assert g["tokens"][pos] == tok, f"prompt {i} position {pos}: {g['tokens']} vs {b['tokens']}"
            assert abs(gtop2[0] - top2[0]) < MAX_DRIFT, f"prompt {i} position {pos}: {gtop2[0]} vs {top2[0]}"
            compared += 1
    return compared
