"""How much of Megatron-LM's own launch scripts pretrain_gpt.py understands.

Reads the GPT example scripts (examples/{gpt3,llama,mixtral}/*.sh) and the GPT pretraining
functional-test configs (tests/functional_tests/test_cases/gpt/*/model_config.yaml, less the
inference and GRPO ones) of a Megatron-LM checkout, classifies every flag use the way
pretrain_gpt.py treats it, and tries to parse each source (data and tokenizer flags replaced
by --mock-data, paths by a temporary folder, world size TP x PP, or the smallest multiple of it
that the expert groups EP x expert TP x PP tile too):

    git clone https://github.com/NVIDIA/Megatron-LM /tmp/Megatron-LM
    python benchmarks/megatron_lm_flag_coverage.py --megatron-lm /tmp/Megatron-LM
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import io
import math
import os
import re
import shlex
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mfsdp.training.arguments import accepted, build_parser, parse_args  # noqa: E402

LAUNCHER_FLAGS = {"--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port"}
DATA_FLAGS = {
    "--data-path",
    "--vocab-file",
    "--merge-file",
    "--tokenizer-model",
    "--tokenizer-type",
    "--split",
    "--mock-data",
    "--data-cache-path",
    "--vocab-size",
}
PATH_FLAGS = {"--save", "--load", "--tensorboard-dir", "--wandb-save-dir", "--pretrained-checkpoint"}
KINDS = (
    "ours (same meaning)",
    "accepted, not applicable",
    "refused: context parallel",
    "refused: other unsupported feature",
    "refused: other Megatron-LM 0.16.1 flag",
    "not a Megatron-LM 0.16.1 flag",
)


def script_options(path: str) -> list[tuple[str, list[str]]]:
    """(flag, values) of a bash launch script: its --flags and the words after them, split as
    the shell does (quoted values stay one word; ``$VAR`` values are kept for try_parse)."""
    text = open(path).read().replace("\\\n", " ")
    try:
        words = shlex.split(text, comments=True)
    except ValueError:  # an unbalanced quote in a heredoc or comment: fall back to words
        words = re.findall(r"\S+", text)
    # bash arrays hold quoted groups such as ("--num-workers 1"): split those again
    words = [w for word in words for w in (shlex.split(word) if word.startswith("--") and " " in word else [word])]
    out = []
    for word in words:
        word = word.strip("()")
        if word in ("if", "then", "else", "elif", "fi", "[", "]", "[[", "]]", ";"):
            continue
        if re.fullmatch(r"--[A-Za-z][\w-]*", word):
            out.append((word, []))
        elif out and word and not word.startswith("torchrun") and not re.fullmatch(r"\w+\+?=.*", word):
            out[-1][1].append(word)
    return [(flag, values) for flag, values in out if flag not in LAUNCHER_FLAGS]


def config_options(path: str) -> list[tuple[str, list[str]]]:
    """(flag, values) of a functional-test model_config.yaml's MODEL_ARGS (true: the bare flag)."""
    import yaml

    out = []
    for flag, value in (yaml.safe_load(open(path)).get("MODEL_ARGS") or {}).items():
        if value is False:
            continue
        values = [] if value is True else [str(v) for v in (value if isinstance(value, list) else [value])]
        out.append((flag, values))  # one word per YAML value, as the harness quotes it
    return out


def sources(root: str) -> dict[str, list[tuple[str, list[str]]]]:
    found = {}
    for path in sorted(glob.glob(f"{root}/examples/*/*.sh")):
        if path.split("/")[-2] in ("gpt3", "llama", "mixtral"):
            found[os.path.relpath(path, root)] = script_options(path)
    for path in sorted(glob.glob(f"{root}/tests/functional_tests/test_cases/gpt/*/model_config.yaml")):
        if not re.search(r"inference|grpo", path.split("/")[-2]):
            found[os.path.relpath(path, root)] = config_options(path)
    return found


def classify(flag: str, ours: set, megatron: frozenset, refused: dict) -> str:
    if flag in accepted.NOT_APPLICABLE:
        return KINDS[1]
    if flag in refused:
        return KINDS[2] if refused[flag] == "context parallelism" else KINDS[3]
    if flag in ours:
        return KINDS[0]
    return KINDS[4] if flag in megatron else KINDS[5]


def _multi_valued(parser) -> set:
    return {o for a in parser._actions if a.nargs in ("*", "+") or (a.nargs or 1) != 1 for o in a.option_strings}


def try_parse(options, folder: str, multi: set) -> str | None:
    """None if the source parses, else argparse's error line. Flags whose value is a ``$VAR`` of
    the launcher's environment are left out (paths get a temporary folder)."""
    argv = []
    for flag, values in options:
        if flag in DATA_FLAGS:
            continue
        if flag in PATH_FLAGS:
            values = [os.path.join(folder, flag.strip("-"))]
        elif any(v.startswith("$") for v in values):
            continue  # set by the test harness's environment (a W&B name, a seed): left unset
        if flag in multi:  # e.g. --data-path "1 a 1 b": several words
            values = [w for v in values for w in v.split()]
        argv += [flag, *values]
    argv += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]
    sizes = dict((f, v) for f, v in options if v and v[0].isdigit())
    tp, pp, ep = (
        int(sizes.get(f"--{name}-model-parallel-size", ["1"])[0]) for name in ("tensor", "pipeline", "expert")
    )
    etp = int(sizes.get("--expert-tensor-parallel-size", [str(tp)])[0])
    world = math.lcm(tp * pp, ep * etp * pp)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse_args(argv, world_size=world)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1].replace("pretrain_gpt.py: error: ", "")
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout (any tag)")
    p.add_argument("--show-unrecognized", action="store_true", help="list the flags not recognized")
    args = p.parse_args()
    found = sources(args.megatron_lm)
    if not found:
        sys.exit(f"--megatron-lm {args.megatron_lm}: no examples/ or functional-test configs found there")
    parser = build_parser()
    ours = set(parser._option_string_actions)
    megatron = accepted.megatron_lm_flags()
    refused = accepted.unsupported_names(megatron)
    kinds, per_flag = collections.Counter(), collections.defaultdict(collections.Counter)
    failures = collections.Counter()
    with tempfile.TemporaryDirectory() as folder:
        parsed = []
        for name, options in found.items():
            for flag, _ in options:
                kind = classify(flag, ours, megatron, refused)
                kinds[kind] += 1
                per_flag[kind][flag] += 1
            error = try_parse(options, folder, _multi_valued(parser))
            if error is None:
                parsed.append(name)
            else:
                failures[error] += 1
    scripts = [n for n in found if n.endswith(".sh")]
    total = sum(kinds.values())
    print(f"{len(scripts)} example scripts + {len(found) - len(scripts)} GPT pretraining configs, {total} flag uses")
    for kind in KINDS:
        print(f"  {kind:45s} {kinds[kind]:6d} ({100 * kinds[kind] / total:5.1f}%)")
    recognized = kinds[KINDS[0]] + kinds[KINDS[1]]
    print(f"recognized (ours + accepted): {recognized}/{total} = {100 * recognized / total:.1f}%")
    print(f"parse: {len(parsed)}/{len(found)} sources ({sum(n in parsed for n in scripts)}/{len(scripts)} scripts)")
    for error, count in failures.most_common():
        print(f"  {count:4d} x {error}")
    if args.show_unrecognized:
        for kind in KINDS[2:]:
            print(f"{kind}: " + ", ".join(f"{f} ({c})" for f, c in per_flag[kind].most_common()))


if __name__ == "__main__":
    main()
