"""Every flag of Megatron-LM's argument parser at HEAD is exactly one of: implemented (pretrain_gpt.py's
own parser), accepted with a one-line start-up notice saying what happens instead, or refused before any
work naming the flag and why. Nothing is silently ignored or silently replaced.

The flags are tests/megatron_lm_head_flags.tsv: every option string that Megatron-LM's
``add_megatron_arguments`` (megatron/training/arguments.py) registers, and ``add_modelopt_args``
(megatron/post_training/arguments.py, which pretrain_gpt.py adds when ModelOpt is installed), with
its argument group, dest and, where its help says the flag is deprecated, that help text;
extracted by building Megatron-LM's own parser from its source at the commit named in the file.
Regenerate both that file and the package's list (megatron_mfsdp/training/arguments/
megatron_lm_flags.txt, which also keeps the flags of older releases so that old scripts still get
their notice or reason) with

    python tests/unit/test_megatron_flag_coverage.py --git /path/to/Megatron-LM[.git] --rev HEAD

(a checkout or a bare repository; the parser is built in a child process from ``git archive``, with
Python 3.11 shims for the few modules it cannot import here: see ``_dump_parser``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "megatron_lm_head_flags.tsv"
PACKAGE_LIST = ROOT / "megatron_mfsdp" / "training" / "arguments" / "megatron_lm_flags.txt"
OLDER_TAG = "core_v0.16.1"  # the pinned megatron-core's release: its flags that HEAD dropped are kept too


def _tiny() -> list:
    from tests.launch import TINY  # imported here: the extraction below runs without the repository on sys.path

    return list(TINY)


def _head() -> tuple[str, dict]:
    """(commit, {flag: (group, dest, deprecation help)}) of the data file."""
    text = DATA.read_text()
    commit = re.search(r"^# Megatron-LM ([0-9a-f]{40}) ", text, re.M).group(1)
    rows = [line.split("\t") for line in text.splitlines() if line.startswith("--")]
    return commit, {row[0]: (row[1], row[2], row[3] if len(row) > 3 else "") for row in rows}


def _sets() -> tuple[set, set, dict]:
    """(implemented, noticed, {refused flag: reason or None}) over Megatron-LM HEAD's flags."""
    from megatron_mfsdp.training.arguments import accepted, build_parser

    head = _head()[1]
    ours = set(build_parser()._option_string_actions)
    noticed = {f for f in head if f in accepted.NOTICES}
    implemented = {f for f in head if f in ours} - noticed
    refused = {f: accepted.refusal(f) for f in head if f not in implemented | noticed}
    return implemented, noticed, refused


def test_the_flag_list_names_its_commit_and_the_package_knows_every_flag_in_its_group():
    from megatron_mfsdp.training.arguments import accepted

    commit, head = _head()
    assert len(commit) == 40 and len(head) > 800
    groups = accepted.megatron_lm_groups()
    wrong = [f for f, (group, _, _) in head.items() if groups.get(f) != group]
    assert not wrong, f"megatron_lm_flags.txt disagrees with {DATA.name} (regenerate both): {wrong[:10]}"


def test_every_megatron_lm_head_flag_is_implemented_noticed_or_refused_with_a_reason():
    from megatron_mfsdp.training.arguments import accepted, refused

    implemented, noticed, refusals = _sets()
    head = set(_head()[1])
    assert implemented | noticed | set(refusals) == head
    assert not (implemented & noticed) and not (set(refusals) & (implemented | noticed))
    no_reason = sorted(f for f, why in refusals.items() if not why)
    assert not no_reason, f"refused without a reason (add it to refused.py or accepted.py): {no_reason}"
    # A per-flag sentence or notice for a flag that is implemented would be dead text.
    assert not set(refused.REASONS) & implemented, set(refused.REASONS) & implemented
    assert not set(refused.REASONS) & set(accepted.NOTICES)
    print(
        f"Megatron-LM HEAD: {len(head)} flags: {len(implemented)} implemented, {len(noticed)} accepted with a "
        f"notice, {len(refusals)} refused"
    )


def _argv_for(parser, flag: str, value: str) -> list:
    """``flag`` as a user gives it: alone for a switch, else with ``value`` (or a valid choice)."""
    action = parser._option_string_actions[flag]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, str(next(c for c in action.choices if c != action.default))]
    return [flag, value]


def test_each_refused_flag_exits_2_before_any_work_naming_itself_and_its_reason(capsys):
    """Given at a value that matters (7, a non-default choice or the bare switch); the expert
    tensor-parallel size matters only with experts, so --num-experts follows it (refused after it)."""
    from megatron_mfsdp.training.arguments import full_parser, parse_args

    parser = full_parser()
    wrong = []
    for flag, why in sorted(_sets()[2].items()):
        argv = _argv_for(parser, flag, "7") + (
            ["--num-experts", "4"] if flag == "--expert-tensor-parallel-size" else []
        )
        try:
            parse_args(_tiny() + argv, world_size=2)
            code = None
        except SystemExit as exit_:
            code = exit_.code
        err = capsys.readouterr().err
        if code != 2 or f"error: {flag}: {why}" not in err:
            wrong.append((flag, code, err.strip().splitlines()[-1:]))
    assert not wrong, wrong


def test_each_noticed_flag_parses_and_prints_one_line_saying_what_happens_instead():
    from megatron_mfsdp.training.arguments import accepted, full_parser, parse_args

    parser = full_parser()
    noticed = sorted(_sets()[1])
    plain = set(parse_args(_tiny(), world_size=2).notices)
    for flag in noticed:
        args = parse_args(_tiny() + _argv_for(parser, flag, "x"), world_size=2)
        new = [n for n in args.notices if n not in plain]
        assert new == [f"{flag}: {accepted.NOTICES[flag]}"], (flag, new)
    together = [t for flag in noticed for t in _argv_for(parser, flag, "x")]
    args = parse_args(_tiny() + together, world_size=2)
    assert len([n for n in args.notices if n not in plain]) == len(noticed)


def test_deprecated_no_ops_say_so_in_megatron_lms_words():
    """Megatron-LM's deprecated flags that it still accepts print its deprecation text; the ones of
    HEAD's list are all implemented, noticed as deprecated, or refused (a deprecated alias of a
    feature megatron-mfsdp lacks)."""
    from megatron_mfsdp.training.arguments import accepted

    implemented, noticed, refusals = _sets()
    for flag, text in accepted.DEPRECATED.items():
        assert "deprecated" in text.lower(), flag
    deprecated = {f for f, (_, _, note) in _head()[1].items() if note}
    assert deprecated & set(accepted.DEPRECATED), "no deprecated flag of HEAD is in DEPRECATED"
    assert deprecated <= implemented | noticed | set(refusals)
    assert {"--use-dist-ckpt", "--no-async-tensor-model-parallel-allreduce", "--use-mcore-models"} <= set(
        accepted.DEPRECATED
    )


def test_no_weight_decay_cond_type_sets_what_megatron_sets():
    from megatron_mfsdp.training.arguments import parse_args

    assert not parse_args(_tiny(), world_size=2).apply_wd_to_qk_layernorm
    args = parse_args(_tiny() + ["--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm"], world_size=2)
    assert args.apply_wd_to_qk_layernorm


# ---------------------------------------------------------------- extraction (run by hand, see above)


def _dump_parser(tree: str) -> list[dict]:
    """Build Megatron-LM's parser from the source tree ``tree`` in this process and describe every action.

    Megatron-LM needs Python 3.12 (typing.override) and a few packages that are not installed here
    (triton, modelopt, wandb): a module of its own that fails to import one of those is replaced by a
    stub, which is enough to build the parser (none of them adds flags)."""
    import importlib.abc
    import importlib.machinery
    import types
    import typing

    import typing_extensions

    typing.override = getattr(typing, "override", typing_extensions.override)

    class Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return Stub(f"{self.__name__}.{name}")

        def __call__(self, *args, **kwargs):
            return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else Stub("call")

        def __mro_entries__(self, bases):
            return (object,)

    class Tolerant(importlib.abc.Loader):
        def __init__(self, inner):
            self.inner = inner

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            try:
                self.inner.exec_module(module)
            except ModuleNotFoundError as err:
                if (err.name or "").startswith("megatron"):
                    raise
                module.__class__ = Stub

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if not name.startswith("megatron"):
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = Tolerant(spec.loader)
            return spec

    sys.path.insert(0, tree)
    sys.meta_path.insert(0, Finder())
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    try:  # pretrain_gpt.py adds ModelOpt's flags when ModelOpt is installed
        from megatron.post_training.arguments import add_modelopt_args
    except ImportError:
        add_modelopt_args = None
    if add_modelopt_args is not None:
        add_modelopt_args(parser)
    return [
        {"flags": a.option_strings, "group": g.title, "dest": a.dest, "help": a.help if isinstance(a.help, str) else ""}
        for g in parser._action_groups
        for a in g._group_actions
        if a.option_strings and a.dest != "help"
    ]


def _parser_of(git: str, rev: str) -> tuple[str, list[dict]]:
    """(commit, actions) of Megatron-LM's parser at ``rev`` of the repository ``git``."""
    commit = subprocess.run(["git", "-C", git, "rev-parse", rev], capture_output=True, text=True, check=True)
    commit = commit.stdout.strip()
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.run(["git", "-C", git, "archive", commit, "megatron"], capture_output=True, check=True)
        subprocess.run(["tar", "x", "-C", tree], input=archive.stdout, check=True)
        out = subprocess.run(
            [sys.executable, __file__, "--dump", tree], capture_output=True, text=True, check=True, cwd=tree
        )
    return commit, json.loads(out.stdout.strip().splitlines()[-1])


def _is_deprecated(help_text: str) -> bool:
    return "deprecated" in help_text.lower()


def regenerate(git: str, rev: str) -> None:
    """Write DATA (HEAD's flags) and PACKAGE_LIST (HEAD's and the older release's, with their groups)."""
    commit, actions = _parser_of(git, rev)
    rows = {}
    for action in actions:
        note = " ".join(action["help"].split()) if _is_deprecated(action["help"]) else ""
        for flag in action["flags"]:
            rows[flag] = (action["group"], action["dest"], note)
    lines = [
        f"# Megatron-LM {commit} ({rev}): every option string of megatron/training/arguments.py add_megatron_arguments",
        "# and megatron/post_training/arguments.py add_modelopt_args (pretrain_gpt.py adds them with ModelOpt)",
        "# flag<TAB>argument group<TAB>dest<TAB>Megatron-LM's help where it says the flag is deprecated",
        "# regenerate: python tests/unit/test_megatron_flag_coverage.py --git MEGATRON_LM --rev HEAD",
    ]
    DATA.write_text("\n".join(lines + ["\t".join((f, *rows[f])) for f in sorted(rows)]) + "\n")
    older_commit, older = _parser_of(git, OLDER_TAG)
    groups = {f: rows[f][0] for f in rows}
    kept = {f: a["group"] for a in older for f in a["flags"] if f not in groups}
    text = [
        "# Every flag of Megatron-LM's pretrain_gpt.py parser (megatron/training/arguments.py add_megatron_arguments,",
        "# with ModelOpt's add_modelopt_args from megatron/post_training/arguments.py)",
        f"# at {commit} ({rev}), then those of {OLDER_TAG} ({older_commit}) that it no longer has, each with its",
        "# argument group (pretrain_gpt.py --help groups its flags by these titles). Generated by",
        "# tests/unit/test_megatron_flag_coverage.py; a flag here that megatron-mfsdp neither implements nor lists",
        "# in accepted.py or refused.py is refused with a generic reason (the coverage test forbids that for HEAD).",
    ]
    text += [f"{f}\t{groups[f]}" for f in sorted(groups)] + ["# older releases"]
    text += [f"{f}\t{kept[f]}" for f in sorted(kept)]
    PACKAGE_LIST.write_text("\n".join(text) + "\n")
    print(f"{DATA.relative_to(ROOT)}: {len(rows)} flags at {commit}; {PACKAGE_LIST.relative_to(ROOT)}: +{len(kept)}")


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description="Regenerate the Megatron-LM flag lists (see the module docstring).")
    cli.add_argument("--git", help="a Megatron-LM checkout or bare repository")
    cli.add_argument("--rev", default="HEAD")
    cli.add_argument("--dump", help=argparse.SUPPRESS)  # the child process: describe the parser of this tree
    options = cli.parse_args()
    if options.dump:
        described = _dump_parser(options.dump)
        print("\n" + json.dumps(described))  # the last line; Megatron-LM's imports may print before it
    else:
        regenerate(os.path.abspath(options.git), options.rev)
