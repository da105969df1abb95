"""Megatron-LM's GPT and MoE functional-test configs parse, or each is refused naming a feature megatron-mfsdp
lacks.

The configs are tests/megatron_lm_gpt_configs.json and tests/megatron_lm_moe_configs.json: the ``MODEL_ARGS``
of every tests/functional_tests/test_cases/gpt/*/model_config.yaml (and moe/*/, mixtral/*/) of Megatron-LM at
the commit each names, turned into a command line as Megatron-LM's launcher does
(tests/functional_tests/shell_test_utils/_run_training.sh: ``true`` is the bare switch, ``[a b]`` gives two
words, other values one word, in the file's order, with ``<<`` merges inlined). Regenerate them with

    python tests/unit/test_megatron_gpt_configs.py --git /path/to/Megatron-LM[.git] --rev HEAD [--family moe]

A refusal that does not name one of ``LACKING`` (an unknown flag, a bad value, a flag we should implement
or notice) fails the test: fix it in megatron_mfsdp/training/arguments/, never here.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
FAMILIES = {  # family -> (its list, the test_cases folders it holds)
    "gpt": (ROOT / "tests" / "megatron_lm_gpt_configs.json", ("gpt",)),
    "moe": (ROOT / "tests" / "megatron_lm_moe_configs.json", ("moe", "mixtral")),
}
DATA = FAMILIES["gpt"][0]


def _source(family: str) -> str:
    return " ".join(f"tests/functional_tests/test_cases/{f}/*/model_config.yaml" for f in FAMILIES[family][1]) + (
        " MODEL_ARGS"
    )


SOURCE = _source("gpt")


# What megatron-mfsdp does not have, as its refusals name it: every refused config's error must name one.
LACKING = {
    "MoE features beyond megatron-core's MoE layer": ("MoE", "flex dispatcher"),
    "context parallelism": ("context parallelism",),
    "multi-latent attention at TP above 1, or MLA's latent cache": ("multi-latent attention",),
    "multi-token prediction": ("multi-token prediction",),
    "Mamba and hybrid models": ("Mamba", "hybrid model"),
    "experimental attention variants": ("experimental attention variants",),
    "attention output gate": ("attention output gate",),
    "heterogeneous layers": ("heterogeneous layer",),
    "inference engine": ("inference engine",),
    "reinforcement learning": ("reinforcement learning",),
    "Megatron-FSDP and torch FSDP2": ("Megatron-FSDP", "FSDP2"),
    "ModelOpt and distillation": ("ModelOpt", "distillation"),
    "muP": ("muP",),
    "FIM datasets": ("FIM datasets",),
    "CUDA graphs": ("CUDA graphs",),
    "custom pipeline layouts": ("custom pipeline layouts",),
    "activation offloading": ("activation offloading",),
    "inference-only kernels": ("inference-only kernels",),
    "Megatron-LM HEAD's layer-wise distributed optimizer": ("layer-wise distributed optimizer",),
    "position embeddings other than RoPE and learned": ("position embeddings are not supported",),
}
ERROR = re.compile(r"^pretrain_gpt\.py: error: (--[\w-]+\b.*)$", re.M)
SIZES = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size")
EXPERT_SIZES = ("--expert-model-parallel-size", "--pipeline-model-parallel-size")


def _configs(family: str = "gpt") -> dict:
    return json.loads(FAMILIES[family][0].read_text())


def _indexed_dataset(prefix: pathlib.Path) -> None:
    """A small Megatron indexed dataset (.bin and .idx that agree), as tools/preprocess_data.py writes."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    for doc in range(4):
        builder.add_document(torch.arange(doc, doc + 50, dtype=torch.int32) % 4, [50])
    builder.finalize(f"{prefix}.idx")


def _make(flag: str, path: str, tokenizer: str | None) -> None:
    """The file ``flag`` names: an indexed dataset (the parser checks .bin against .idx), GPT-2 vocab and
    merges files, or, for --tokenizer-model, an empty file (a folder for HuggingFaceTokenizer): the parser
    checks that it exists and reads no tokenizer."""
    target = pathlib.Path(path)
    if flag == "--data-path":
        if not target.with_suffix(".idx").exists():
            _indexed_dataset(target)
        return
    if flag == "--tokenizer-model" and tokenizer == "HuggingFaceTokenizer":
        target.mkdir(parents=True, exist_ok=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    text = {"--vocab-file": '{"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}', "--merge-file": "#version: 0.2\na b\n"}
    target.write_text(text.get(flag, ""))


def _value(argv: list, flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _world(argv: list) -> int:
    """TP x PP x CP (data-parallel size 1, so every batch size divides), or with experts the least world that
    EP x expert TP (default TP) x PP also tiles, as megatron-core's groups need."""
    dense = math.prod(int(_value(argv, flag) or 1) for flag in SIZES)
    etp = _value(argv, "--expert-tensor-parallel-size") or _value(argv, "--tensor-model-parallel-size") or 1
    return math.lcm(dense, int(etp) * math.prod(int(_value(argv, flag) or 1) for flag in EXPERT_SIZES))


@pytest.fixture(scope="module", params=list(FAMILIES))
def command_lines(request, tmp_path_factory) -> tuple[str, dict]:
    """A family's name and each config's command line with its placeholders pointed at real files in one
    folder, and its world size (:func:`_world`). Megatron-LM's CI sets $REPEAT (the --seed of one config) to
    the run's number and $DATA_BLEND to a data prefix."""
    family = request.param
    folder = tmp_path_factory.mktemp(f"megatron_lm_{family}_configs")
    values = {"REPEAT": "1", "DATA_BLEND": str(folder / "DATA_BLEND")}
    out = {}
    for name, config in _configs(family)["configs"].items():
        argv = [
            re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), str(folder / m.group(1))), word)
            for word in config
        ]
        for i, word in enumerate(argv[:-1]):
            made = word in ("--data-path", "--vocab-file", "--merge-file", "--tokenizer-model")
            if made and argv[i + 1].startswith(str(folder)):  # a placeholder's path: nothing lands elsewhere
                _make(word, argv[i + 1], _value(argv, "--tokenizer-type"))
        out[name] = (argv, _world(argv))
    return family, out


def _outcome(argv: list, world: int) -> tuple:
    """("parses", the parsed namespace) or ("refused", exit code, the error that names a flag, else the last
    line written)."""
    from megatron_mfsdp.training.arguments import parse_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parse_args(argv, world_size=world)
    except SystemExit as exit_:
        errors = ERROR.findall(err.getvalue())
        return ("refused", exit_.code, errors[-1] if errors else err.getvalue().strip()[-300:])
    return ("parses", vars(args))


def _feature(error: str) -> str | None:
    """The lacking feature an error names (None for none, or for an error that names no flag)."""
    named = error.startswith("--")
    return next((f for f, words in LACKING.items() if named and any(w in error for w in words)), None)


def test_each_config_parses_or_is_refused_naming_a_feature_megatron_mfsdp_lacks(command_lines, monkeypatch):
    """The parser refuses --wandb-project where the wandb package is missing (Megatron-LM fails at its import
    too); Megatron-LM's CI has it, so where it is not installed an empty module stands in."""
    if importlib.util.find_spec("wandb") is None:
        monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    family, command_lines = command_lines
    data = _configs(family)
    outcomes = {name: _outcome(argv, world) for name, (argv, world) in command_lines.items()}
    parsed = [name for name, o in outcomes.items() if o[0] == "parses"]
    refused = {name: o for name, o in outcomes.items() if o[0] == "refused"}
    wrong = {name: o[1:] for name, o in refused.items() if o[1] != 2 or not _feature(o[2])}
    assert not wrong, f"refused without naming a feature megatron-mfsdp lacks (fix the argument layer): {wrong}"
    features = collections.Counter(_feature(o[2]) for o in refused.values())
    print(
        f"\nMegatron-LM {family} functional-test configs at {data['commit']}: {len(parsed)} parse, "
        f"{len(refused)} refused naming a lacking feature: {dict(features.most_common())}"
    )
    assert len(parsed) + len(refused) == len(data["configs"]) == len(command_lines)
    assert parsed and refused
    # One process parses them all: parsing leaves nothing behind (the same outcome again, in reverse order).
    again = {name: _outcome(*command_lines[name]) for name in reversed(list(command_lines))}
    assert again == outcomes


@pytest.mark.parametrize(
    "words",
    [["--temperature", "1.0"], ["--top_k", "1"], ["--return-log-probs"], ["--incoming-requests-per-sec", "-1"]],
)
def test_a_flag_of_megatron_lms_inference_scripts_is_refused_naming_the_inference_engine(words):
    """The inference configs give them (megatron/inference/utils.py add_inference_args): not unknown flags."""
    from tests.launch import TINY

    outcome = _outcome(TINY + words, 1)
    assert outcome[:2] == ("refused", 2) and outcome[2].startswith(f"{words[0]}: a flag of Megatron-LM's inference")
    assert _feature(outcome[2]) == "inference engine"


def test_the_config_list_is_megatron_lms_at_a_named_commit():
    data, moe = _configs(), _configs("moe")
    assert re.fullmatch(r"[0-9a-f]{40}", data["commit"]) and data["source"] == SOURCE
    assert moe["commit"] == data["commit"] and moe["source"] == _source("moe")
    assert len(data["configs"]) + len(data["empty"]) > 200 and len(moe["configs"]) + len(moe["empty"]) > 60
    assert all("--num-experts" in argv for argv in moe["configs"].values() if "--spec" not in argv)
    tp2_pp2 = data["configs"]["gpt3_mcore_te_tp2_pp2"]
    assert tp2_pp2[:4] == ["--num-layers", "12", "--hidden-size", "512"]
    assert tp2_pp2[tp2_pp2.index("--lr-warmup-fraction") + 1] == ".01"  # the YAML text, not a float's repr
    assert "--use-mcore-models" in tp2_pp2 and "true" not in tp2_pp2


def test_a_model_config_becomes_the_command_line_megatron_lms_launcher_passes():
    text = """
BASE: &BASE
  --num-layers: 2
  --bf16: true
  --sequence-parallel: true
MODEL_ARGS:
  <<: *BASE
  --bf16: false  # an explicit key wins over the merged one
  --min-lr: 1.0e-5
  --hierarchical-context-parallel-sizes: "[2 2]"
  --stop-words: '"the"'
  --prompts: "two  words"
  --data-cache-path: ""
  --load: ${CHECKPOINT_LOAD_PATH}/model
"""
    assert model_args(text) == (
        ["--num-layers", "2", "--sequence-parallel", "--min-lr", "1.0e-5"]
        + ["--hierarchical-context-parallel-sizes", "2", "2", "--stop-words", "the", "--prompts", "two words"]
        + ["--load", "${CHECKPOINT_LOAD_PATH}/model"]
    )
    assert model_args("MODEL_ARGS:\nTEST_TYPE: regular\n") is None


# ---------------------------------------------------------------- extraction (run by hand, see above)


def _mapping_pairs(node) -> list:
    """(key, value node) pairs of a YAML mapping node, ``<<`` merges inlined first (explicit keys win),
    as yq's ``explode(.)`` does for the launcher."""
    merged, explicit = [], []
    for key, value in node.value:
        if key.value == "<<":
            merged += _mapping_pairs(value)
        else:
            explicit.append((key.value, value))
    taken = {k for k, _ in explicit}
    return [(k, v) for k, v in merged if k not in taken] + explicit


def _words(flag: str, node) -> list:
    """The launcher's words for one MODEL_ARGS entry: the bare switch for true, nothing for false or an
    empty value, ``[a b]`` split into words, any other value one word (its shell quotes removed by the
    launcher's ``xargs``). The scalar's own text is kept (yq prints ``1.0e-5`` as written)."""
    import yaml

    if not isinstance(node, yaml.ScalarNode):
        raise ValueError(f"{flag}: a {node.tag} value (the launcher passes scalars only)")
    text = node.value
    if node.tag == "tag:yaml.org,2002:bool":
        if text not in ("true", "false"):
            raise ValueError(f"{flag}: {text!r} (yq reads only true/false as booleans)")
        return [flag] if text == "true" else []
    if node.tag == "tag:yaml.org,2002:null" or text == "":
        return []
    text = " ".join(shlex.split(text))
    if re.fullmatch(r"\[[^]]+\]", text):
        return [flag, *text[1:-1].split()]
    return [flag, text]


def model_args(text: str) -> list | None:
    """The command line of one model_config.yaml's MODEL_ARGS (None when it has none)."""
    import yaml

    root = yaml.compose(text)
    node = dict((k.value, v) for k, v in root.value).get("MODEL_ARGS")
    if node is None or node.tag == "tag:yaml.org,2002:null":
        return None
    return [word for flag, value in _mapping_pairs(node) for word in _words(flag, value)]


def _git(git: str, *args) -> str:
    return subprocess.run(["git", "-C", git, *args], capture_output=True, text=True, check=True).stdout


def regenerate(git: str, rev: str, family: str = "gpt") -> None:
    """Write the family's list from the configs of ``rev`` of the Megatron-LM repository ``git``."""
    commit = _git(git, "rev-parse", rev).strip()
    target, folders = FAMILIES[family]
    paths = []
    for folder in folders:
        listed = _git(git, "ls-tree", "-r", "--name-only", commit, f"tests/functional_tests/test_cases/{folder}/")
        paths += [p for p in listed.split() if p.count("/") == 5]
    configs, empty = {}, []
    for path in sorted(p for p in paths if p.endswith("/model_config.yaml")):
        name = path.split("/")[-2]
        if name in configs or name in empty:
            raise ValueError(f"{path}: a second config named {name}")
        argv = model_args(_git(git, "show", f"{commit}:{path}"))
        if argv is None:
            empty.append(name)
        else:
            configs[name] = argv
    data = {
        "commit": commit,
        "source": _source(family),
        "note": "Each config's MODEL_ARGS as Megatron-LM's launcher (tests/functional_tests/shell_test_utils/"
        "_run_training.sh) passes them, in order: true gives the bare switch, a false-valued switch is dropped "
        "(the launcher would pass the word false), [a b] gives two words, ${VAR} placeholders are kept. "
        "'empty' lists the configs whose MODEL_ARGS is empty (their test runs a script of its own). "
        f"Generated by tests/unit/test_megatron_gpt_configs.py --git MEGATRON_LM --rev REV --family {family}.",
        "empty": empty,
        "configs": configs,
    }
    head = json.dumps({k: v for k, v in data.items() if k != "configs"}, indent=1).removesuffix("\n}")
    lines = [f"  {json.dumps(name)}: {json.dumps(argv)}" for name, argv in configs.items()]  # one line each
    target.write_text(head + ',\n "configs": {\n' + ",\n".join(lines) + "\n }\n}\n")
    print(f"{target.relative_to(ROOT)}: {len(configs)} configs (+{len(empty)} empty) at {commit}")


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="Regenerate the Megatron-LM GPT config list (see the docstring).")
    cli.add_argument("--git", required=True, help="a Megatron-LM checkout or bare repository")
    cli.add_argument("--rev", default="HEAD")
    cli.add_argument("--family", default="gpt", choices=list(FAMILIES))
    options = cli.parse_args()
    regenerate(os.path.abspath(options.git), options.rev, options.family)
