"""The score-path feature matrix the kernel test files share, and readable ids for its cases."""

import itertools

FEATURES = list(
    itertools.product(
        [None, 5.0],  # softcap
        [False, True],  # alibi
        [None, (5, 2)],  # window
        [None, "top_left", "bottom_right"],  # causal alignment
        [None, "bool", "float"],  # attn_mask
    )
)


def feature_id(case: int) -> str:
    """What case ``case`` of FEATURES turns on, e.g. "47-softcap-window-causal_top_left-mask_float"
    (its index first, so that ids stay unique and findable; "47-plain" where nothing is on)."""
    softcap, alibi, window, causal, mask = FEATURES[case]
    parts = [
        "softcap" if softcap is not None else "",
        "alibi" if alibi else "",
        "window" if window is not None else "",
        f"causal_{causal}" if causal is not None else "",
        f"mask_{mask}" if mask is not None else "",
    ]
    return "-".join([str(case), *(p for p in parts if p)]) if any(parts) else f"{case}-plain"
