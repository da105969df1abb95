"""compat/fallbacks.py: megatron-core's fallback warnings (its messages at core_v0.16.1, as
tools/generate.py records them on this machine) told in one line; other warnings shown as Python
shows them. tests/e2e/test_quickstart.py runs the tools themselves."""

import io
import warnings

from megatron_mfsdp.compat.fallbacks import fallback, fallback_line, report

TE_APEX = "Transformer Engine and Apex are not installed. Falling back to "
GENERATE_RUN = [
    (UserWarning, TE_APEX + "local implementations of multi_tensor_applier and multi_tensor_scale"),
    (UserWarning, TE_APEX + "Torch optimizers."),
    (UserWarning, TE_APEX + "local implementations of multi_tensor_applier and multi_tensor_scale"),
    (
        UserWarning,
        TE_APEX + "local implementations of multi_tensor_applier, multi_tensor_l2norm, and multi_tensor_scale",
    ),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm"),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm"),
    (UserWarning, "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer."),
    (FutureWarning, "`load_state_dict` is deprecated and will be removed in future versions."),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor."),
]
LINE = (
    "Transformer Engine and Apex are not installed: megatron-core runs Torch optimizers and local "
    "multi_tensor_applier, multi_tensor_l2norm and multi_tensor_scale instead; Apex is not installed: "
    "megatron-core runs Torch Norm instead"
)


def _recorded(pairs) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for category, message in pairs:
            warnings.warn(message, category, stacklevel=1)
    return caught


def test_a_fallback_names_what_is_missing_and_each_thing_that_runs_instead():
    assert fallback(GENERATE_RUN[3][1]) == (
        "Transformer Engine and Apex",
        ["local multi_tensor_applier", "local multi_tensor_l2norm", "local multi_tensor_scale"],
    )
    assert fallback(GENERATE_RUN[1][1]) == ("Transformer Engine and Apex", ["Torch optimizers"])
    assert fallback("Apex is not installed. Falling back to Torch Norm") == ("Apex", ["Torch Norm"])
    assert fallback(GENERATE_RUN[6][1]) is None


def test_the_runs_warnings_make_one_line_each_thing_named_once():
    assert fallback_line(message for _, message in GENERATE_RUN) == LINE
    assert fallback_line(["something else"]) is None


def test_report_prints_one_notice_and_shows_any_other_warning(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    stream = io.StringIO()
    report(_recorded(GENERATE_RUN + [(RuntimeWarning, "overflow in exp")]), "generate.py", stream)
    lines = stream.getvalue().splitlines()
    assert lines[-1] == (
        f"> notice: generate.py: {LINE} (9 warnings, 3 of them deprecations inside the libraries; "
        "-W default shows them)"
    )
    assert "RuntimeWarning: overflow in exp" in lines[0] and len(lines) == 3  # formatwarning's two lines


def test_only_rank_0_prints_the_notice_and_none_means_python_showed_them(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    stream = io.StringIO()
    report(_recorded(GENERATE_RUN), "generate.py", stream)
    assert stream.getvalue() == ""
    monkeypatch.setenv("RANK", "0")
    report(None, "generate.py", stream)  # catch_warnings(record=False): -W or PYTHONWARNINGS given
    report([], "generate.py", stream)
    assert stream.getvalue() == ""
