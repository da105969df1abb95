"""QK-clip's Transformer Engine path on a CPU: megatron-core's own TEDotProductAttention (its
``return_max_logit`` request and running max, extensions/transformer_engine.py at core_v0.16.1) around a
stand-in TE kernel (tests/stand_ins/transformer_engine), inside megatron-core's SelfAttention. Its
``current_max_attn_logits`` must equal our CPU attention's on the same weights and inputs, and
training/qk_clip.py must clip from it. Run in a subprocess: the stand-in has to be imported before
megatron-core looks for Transformer Engine."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import types, torch, torch.distributed as dist
from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron_mfsdp.compat.cpu import cuda_on_cpu
from megatron_mfsdp.models.gpt.build import SDPAttention
from megatron_mfsdp.models.gpt import qk_clip as qk
from megatron_mfsdp.testing.tiny import init_megatron, tiny_gpt_config
from megatron_mfsdp.training.qk_clip import QKClip

assert HAVE_TE
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + PORT, rank=0, world_size=1)
init_megatron()
config = tiny_gpt_config(num_layers=1, add_bias_linear=False, qk_clip=True, log_max_attention_logit=True)

def attention(core):
    spec = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear, core_attention=core, linear_proj=RowParallelLinear
        ),
    )
    torch.manual_seed(0)
    return build_module(spec, config=config, layer_number=1)

te, ours = attention(TEDotProductAttention), attention(SDPAttention)
assert isinstance(te.core_attention, TEDotProductAttention)
ours.load_state_dict(te.state_dict())
outs = {}
with cuda_on_cpu():
    for step in range(2):
        # the first batch holds the max: the running max is checked, not the last batch's
        x = torch.randn(16, 2, config.hidden_size, generator=torch.Generator().manual_seed(step)) * (4 - 3 * step)
        for name, m in (("te", te), ("ours", ours)):
            outs.setdefault(name, []).append(m(x, None)[0])
calls = te.core_attention.calls
te_max, our_max = te.core_attention.current_max_attn_logits, ours.core_attention.current_max_attn_logits
out_delta = max((a - b).abs().max().item() for a, b in zip(outs["te"], outs["ours"]))
max_delta = ((te_max - our_max).abs() / our_max.abs()).max().item()

scaled = {}
class Owner:  # MatrixFSDPOptimizer.scale_rows's caller side only: what the clip asks the owners
    def scale_rows(self, scales):
        scaled.update(scales)

threshold = float(te_max.max()) / 2
args = types.SimpleNamespace(qk_clip=True, qk_clip_alpha=0.5, qk_clip_threshold=threshold)
clip = QKClip(args, [te], types.SimpleNamespace(dp=None))
clip(Owner())
expected = dict(qk.clipped_weights(ours, our_max, threshold, 0.5))[ours.linear_qkv.weight]
rows = scaled["linear_qkv.weight"]
print("RESULT", calls, out_delta, max_delta, clip.last, float(our_max.max()),
      (rows - expected).abs().max().item(), int((rows < 1).sum()), te.core_attention.current_max_attn_logits)
"""


def test_te_attentions_max_logits_equal_ours_and_drive_the_clip(tmp_path):
    from megatron_mfsdp.testing.workers import free_port

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "stand_ins"), str(ROOT)]))
    script = SCRIPT.replace("PORT", repr(str(free_port())))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    calls, out_delta, max_delta, last, ours_max, rows_delta, clipped, reset = lines[0].split()[1:]
    print(f"\nTE path on a CPU stand-in: outputs {out_delta}, max logits {max_delta} (relative) from ours")
    assert int(calls) == 2  # megatron-core's TEDotProductAttention ran the stand-in kernel, once a forward
    assert float(out_delta) <= 1e-5 and float(max_delta) <= 1e-6
    assert abs(float(last) - float(ours_max)) <= 1e-6 * float(ours_max)  # the logged largest logit
    assert float(rows_delta) <= 1e-7 and int(clipped) > 0  # the clip's row multipliers, from TE's max logits
    assert reset == "None"  # the running max restarts every step
