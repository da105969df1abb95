"""Run the paper's own benchmark (test/fsdp/bench_fsdp2_compare.py of songbingze/matrix-fsdp, a
checkout named by MFSDP_PAPER_CHECKOUT) with its Newton-Schulz in the dtype MFSDP_PAPER_NS_DTYPE
says, for benchmarks/bench_end_to_end.py --paper-checkout. Nothing of the paper's code is changed
or copied; only torch's NS function is swapped at run time.

Its Muon is torch.optim.Muon, whose ``_zeropower_via_newtonschulz`` casts to bf16 with no option.
For fp32 that function is replaced by ours (optim/muon.py, same op order, the "simple" schedule
that torch's default coefficients are). The swap runs at import of this file, and mp.spawn
re-imports the parent's main file in every rank, so every rank of theirs gets it."""

import os
import sys

CHECKOUT = os.environ.get("MFSDP_PAPER_CHECKOUT", "")
NS_DTYPE = os.environ.get("MFSDP_PAPER_NS_DTYPE", "bf16")


def _fp32_newton_schulz():
    import torch
    import torch.optim._muon as torch_muon

    from megatron_mfsdp.optim.newton_schulz import newton_schulz, ns_coefficients_for

    def orthogonalize(grad, ns_coefficients, ns_steps, eps):
        if tuple(ns_coefficients) != ns_coefficients_for("simple", 1)[0]:
            raise ValueError(f"paper_launcher: coefficients {ns_coefficients} are not torch's defaults")
        return newton_schulz(grad, ns_steps, "simple", torch.float32, eps)

    torch_muon._zeropower_via_newtonschulz = orthogonalize


for path in (CHECKOUT, os.path.join(CHECKOUT, "test", "fsdp")):
    if path and path not in sys.path:
        sys.path.insert(0, path)
if NS_DTYPE == "fp32":
    _fp32_newton_schulz()
elif NS_DTYPE != "bf16":
    raise SystemExit(f"MFSDP_PAPER_NS_DTYPE must be bf16 or fp32, got {NS_DTYPE!r}")

if __name__ == "__main__":
    if not os.path.isfile(os.path.join(CHECKOUT, "test", "fsdp", "bench_fsdp2_compare.py")):
        raise SystemExit(f"MFSDP_PAPER_CHECKOUT={CHECKOUT!r}: no test/fsdp/bench_fsdp2_compare.py there")
    import bench_fsdp2_compare

    raise SystemExit(bench_fsdp2_compare.main(sys.argv[1:]))
