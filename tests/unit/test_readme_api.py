"""README's "Using it from your own megatron-core code" block runs as printed, on the tiny GPT in a
one-rank gloo group: the names it leaves to the reader (a TransformerConfig, a GPTModel, a batch)
are the only ones given."""

import pathlib
import re

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_rank_process_group")

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _block() -> str:
    text = README.read_text()
    section = text[text.index("## Using it from your own megatron-core code") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_api_example_trains_a_step(capsys):
    from megatron_mfsdp.testing import init_megatron, tiny_gpt

    init_megatron()
    transformer_config, gpt_model = tiny_gpt()
    before = {n: p.detach().clone() for n, p in gpt_model.named_parameters()}
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    names = {"transformer_config": transformer_config, "gpt_model": gpt_model, "tokens": tokens}
    names["position_ids"] = torch.arange(16).expand_as(tokens)
    exec(_block(), names)  # noqa: S102 - the README's own text, run as a user would
    assert names["optimizer"].config.optimizer == "muon" and "rank" in capsys.readouterr().out
    after = names["model"].full_state_dict()
    assert any(not torch.equal(after[n], before[n]) for n in before)  # it stepped
