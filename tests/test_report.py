"""The report's sweep section: the calibration text named, one row per Gram, λ and J."""

from dofmini.study.report import sweep_section


def test_sweep_section_names_the_calibration_and_gives_each_setting_a_row():
    rows = [
        {"normalize": g, "lam": lam, "J": J, "layer_dof": [10.4, 20.6], "dims": [5, 11]}
        for g in (True, False)
        for lam in (2.0**-4, 1.0)
        for J in (256, 512)
    ]
    results = {"sweep": rows, "dof": {"calibration": "wiki.valid.raw: first 99 tokens, ctx 8"}}
    text = sweep_section({**results, "teacher": {"head_dim": 8}})
    assert "wiki.valid.raw: first 99 tokens, ctx 8" in text and "at 8 features per layer" in text
    assert (
        "| G/J | 2^-4 | 256 | 10 21 | 5 11 |" in text and "| G | 2^0 | 512 | 10 21 | 5 11 |" in text
    )
    assert text.count("| 10 21 |") == 8
    assert sweep_section({"sweep": None}) == ""
