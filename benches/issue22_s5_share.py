"""Issue 22, fifth session: shareprefill's and sample_attention's plans timed by
`estimator_shares.py` (beside cuDNN dense, plan hash, host synchronisations), and with
`--variants` once more with the superseded designs switched back on
(`fast.flexprefill_vs.COMPACT_BY = "sort"`, `fast.kernels.sampled_scores.TILE_TABLE =
"device"`) in the same process.

    python3 benches/issue22_s5_share.py --seqlens 32768 --methods shareprefill sample_attention \
        --json out.json [--variants]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import estimator_shares as shares  # noqa: E402

from sparseprefill import fast  # noqa: E402


def main(argv: list[str]) -> int:
    # DPXA's scoring ratio is not timed here: skip compiling its kernels.
    setattr(fast, "dpxa_scoring_ratio", None)
    variants = "--variants" in argv
    argv = [a for a in argv if a != "--variants"]
    rc = shares.main(argv)
    if variants:
        import sparseprefill.fast.flexprefill_vs as fvs
        import sparseprefill.fast.kernels.sampled_scores as sampled

        setattr(fvs, "COMPACT_BY", "sort")
        setattr(sampled, "TILE_TABLE", "device")
        shares.DONE.clear()
        swapped = [a.replace(".json", "-variants.json") for a in argv]
        tag = ["--tag", "after-sort-devicetable"]
        rc |= shares.main(swapped + tag)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
