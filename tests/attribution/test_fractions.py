"""MIG unit fractions (docs/cost-model.md section 4) and the shipped profile table."""

from __future__ import annotations

import re
from importlib import resources

import numpy as np
import pytest
import yaml

from otelgpu.core.mig import MigProfiles, normalise_per_gpu

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module")
def mig() -> MigProfiles:
    return MigProfiles.load()


@pytest.fixture(scope="module")
def doc() -> dict:
    return yaml.safe_load(resources.files("otelgpu.core").joinpath("data/mig_profiles.yaml").read_text())


@pytest.mark.parametrize("profile,c", [("1g.10gb", 1), ("2g.20gb", 2), ("3g.40gb", 3), ("4g.40gb", 4), ("7g.80gb", 7)])
def test_compute_rule_is_c_over_7(mig, profile, c) -> None:
    f, found = mig.fraction(H100, profile, "compute")
    assert found
    assert f == pytest.approx(c / 7, rel=1e-15)


@pytest.mark.parametrize("profile,want", [
    ("1g.10gb", 1 / 7),           # max(1/7, 1/8)
    ("1g.20gb", 2 / 8),           # max(1/7, 2/8)
    ("2g.20gb", 2 / 7),           # max(2/7, 2/8)
    ("3g.40gb", 0.5),             # max(3/7, 4/8)
    ("4g.40gb", 4 / 7),           # max(4/7, 4/8)
    ("7g.80gb", 1.0),
])
def test_max_rule(mig, profile, want) -> None:
    f, found = mig.fraction(H100, profile, "max")
    assert found
    assert f == pytest.approx(want, rel=1e-15)


def test_same_profile_name_differs_by_memory_size(mig) -> None:
    """1g.10gb is (1, 2) on A100-40GB but (1, 1) on A100-80GB and H100-80GB: resolved from modelName."""
    assert mig.slices("NVIDIA A100-SXM4-40GB", "1g.10gb") == (1, 2, 7, 8)
    assert mig.slices("NVIDIA A100-SXM4-80GB", "1g.10gb") == (1, 1, 7, 8)
    assert mig.slices(H100, "1g.10gb") == (1, 1, 7, 8)
    assert mig.fraction("NVIDIA A100-SXM4-40GB", "1g.10gb", "max") == (pytest.approx(0.25), True)
    assert mig.fraction("NVIDIA A100-SXM4-80GB", "1g.10gb", "max") == (pytest.approx(1 / 7), True)
    # Under the compute rule they cost the same.
    assert mig.fraction("NVIDIA A100-SXM4-40GB", "1g.10gb", "compute")[0] == pytest.approx(1 / 7)


@pytest.mark.parametrize("model,profile,base", [
    (H100, "1g.10gb+me", "1g.10gb"),
    (H100, "3g.40gb+me", "3g.40gb"),  # unlisted variant: falls back to its base profile
    ("NVIDIA A100-SXM4-40GB", "1g.5gb+me", "1g.5gb"),
    ("NVIDIA A100-SXM4-40GB", "1g.10gb+me", "1g.10gb"),  # (1, 2), not H100's (1, 1)
    ("NVIDIA A30", "2g.12gb+me", "2g.12gb"),
    ("NVIDIA H200", "1g.18gb+me", "1g.18gb"),
])
def test_me_variants_take_base_slices(mig, model, profile, base) -> None:
    assert mig.slices(model, profile) == mig.slices(model, base) is not None
    for rule in ("compute", "max"):
        assert mig.fraction(model, profile, rule) == mig.fraction(model, base, rule)


def test_a30_has_four_compute_slices(mig) -> None:
    assert mig.fraction("NVIDIA A30", "2g.12gb", "compute") == (0.5, True)
    assert mig.fraction("NVIDIA A30", "2g.12gb", "max") == (0.5, True)
    assert mig.fraction("NVIDIA A30", "1g.6gb", "compute") == (0.25, True)
    assert mig.fraction("NVIDIA A30", "4g.24gb", "compute") == (1.0, True)


@pytest.mark.parametrize("model", ["Some Future GPU", "Tesla T4", ""])
def test_unknown_model_falls_back_to_c_over_7(mig, model) -> None:
    assert mig.family_for(model) is None
    assert mig.slices(model, "3g.40gb") is None
    for rule in ("compute", "max"):
        f, found = mig.fraction(model, "3g.40gb", rule)
        assert not found
        assert f == pytest.approx(3 / 7)
    assert mig.fraction(model, "7g.80gb", "compute") == (pytest.approx(1.0), False)


def test_unknown_profile_on_known_model_is_not_found(mig) -> None:
    f, found = mig.fraction(H100, "2g.99gb", "compute")
    assert not found and f == pytest.approx(2 / 7)


def test_normalise_per_gpu_under_max_rule(mig) -> None:
    f43 = mig.fraction(H100, "4g.40gb", "max")[0]
    f33 = mig.fraction(H100, "3g.40gb", "max")[0]
    assert f43 + f33 == pytest.approx(4 / 7 + 0.5)  # 1.0714: the GPU would be sold 1.07 times
    gpu = np.array([0, 0, 1, 1, 2])
    f = np.array([f43, f33, 0.25, 0.5, 1.0])
    out = normalise_per_gpu(gpu, f)
    assert out[0] == pytest.approx(f43 / (f43 + f33))
    assert out[1] == pytest.approx(f33 / (f43 + f33))
    assert out[0] + out[1] == pytest.approx(1.0, rel=1e-15)
    assert out[2:].tolist() == [0.25, 0.5, 1.0]  # other GPUs untouched (sums <= 1)
    assert f.tolist() == [f43, f33, 0.25, 0.5, 1.0]  # input not modified in place


def test_normalise_per_gpu_compute_rule_is_a_no_op(mig) -> None:
    f = np.array([mig.fraction(H100, p, "compute")[0] for p in ("4g.40gb", "3g.40gb")])
    assert normalise_per_gpu(np.array([0, 0]), f).tolist() == pytest.approx([4 / 7, 3 / 7])


def test_normalise_per_gpu_empty() -> None:
    assert len(normalise_per_gpu(np.zeros(0, dtype=np.int64), np.zeros(0))) == 0


def test_every_profile_fits_its_gpu(doc) -> None:
    assert doc["gpus"]
    for fam in doc["gpus"]:
        cs, ms = fam["compute_slices"], fam["memory_slices"]
        assert cs > 0 and ms > 0, fam["family"]
        assert fam["match"], fam["family"]
        for name, (c, m) in fam["profiles"].items():
            assert 1 <= c <= cs, (fam["family"], name)
            assert 1 <= m <= ms, (fam["family"], name)
            assert int(re.match(r"(\d+)g\.\d+gb", name).group(1)) == c, (fam["family"], name)
        whole = [(c, m) for name, (c, m) in fam["profiles"].items() if (c, m) == (cs, ms)]
        assert whole, f"{fam['family']} has no whole-GPU profile"


def test_family_names_are_unique_and_source_is_documented(doc) -> None:
    names = [f["family"] for f in doc["gpus"]]
    assert len(names) == len(set(names))
    assert doc["source"]["retrieved"]
    assert all(d.get("url") for d in doc["source"]["documents"])


@pytest.mark.parametrize("model,family", [
    ("NVIDIA H100 NVL", "H100-94GB"),
    ("NVIDIA GH200 480GB", "GH200-96GB"),
    ("NVIDIA GH200 120GB", "GH200-96GB"),
    ("NVIDIA GH200 144G HBM3e", "GH200-144GB"),
    ("NVIDIA H200", "H200-141GB"),
    ("NVIDIA H200 NVL", "H200-141GB"),
    ("NVIDIA B200", "B200"),
    ("NVIDIA GB200", "GB200"),
    ("NVIDIA B300 SXM6 AC", "B300"),
    ("NVIDIA GB300", "GB300"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
    ("NVIDIA A30", "A30"),
    ("NVIDIA H100 80GB HBM3", "H100-80GB"),
    ("NVIDIA H100 PCIe", "H100-80GB"),
    ("NVIDIA H100", "H100-80GB"),
    ("NVIDIA H800", "H100-80GB"),
    ("NVIDIA H800 PCIe", "H100-80GB"),
    ("NVIDIA H800 NVL", "H100-94GB"),
    ("NVIDIA H20", "H100-96GB"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX-PRO-6000"),
])
def test_real_model_names_resolve_to_intended_family(mig, model, family) -> None:
    fam = mig.family_for(model)
    assert fam is not None, model
    assert fam.family == family


@pytest.mark.parametrize("model", ["Tesla T4", "NVIDIA A10G", "NVIDIA L4", "NVIDIA L40S", "Tesla V100-SXM2-16GB",
                                   "NVIDIA T4G"])
def test_non_mig_gpus_resolve_to_no_family(mig, model) -> None:
    assert mig.family_for(model) is None


def test_catalog_gpu_models_resolve_consistently(mig) -> None:
    """The shipped AWS catalog's MIG-capable models land on the family with the right memory size."""
    from otelgpu.core.catalog import load_catalog

    cat = load_catalog()
    want = {"p4d.24xlarge": "A100-40GB", "p4de.24xlarge": "A100-80GB", "p5.48xlarge": "H100-80GB",
            "p5en.48xlarge": "H200-141GB", "p6-b200.48xlarge": "B200"}
    for itype, family in want.items():
        assert mig.family_for(cat[itype].gpu_model).family == family, itype


def test_resource_and_suffix_forms_reduce_to_their_base_profile() -> None:
    mig = MigProfiles.load()
    assert mig.fraction("NVIDIA H100 80GB HBM3", "mig-1g.10gb", "compute") == (1 / 7, True)
    assert mig.fraction("NVIDIA H100 80GB HBM3", "1g.20gb-me", "max") == (2 / 8, True)
    assert mig.family_for("NVIDIA-H100-80GB-HBM3").family == "H100-80GB"  # GFD product label form


def test_unknown_profile_of_a_known_family_uses_that_family_s_slices() -> None:
    f, found = MigProfiles.load().fraction("NVIDIA A30", "3g.18gb", "compute")
    assert (f, found) == (3 / 4, False)
