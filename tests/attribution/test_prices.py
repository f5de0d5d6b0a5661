"""GPU hourly price (docs/cost-model.md sections 2 and 3) and the shipped AWS catalog."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

from otelgpu.attribution.config import PricesConfig
from otelgpu.attribution.prices import GpuPrice, Pricer, gpu_share_of_instance
from otelgpu.core.catalog import InstanceType, load_catalog

P4D = dict(gpus=8, vcpus=96.0, memory_gib=1152.0)
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(resources.files("otelgpu.core").joinpath("data/aws_gpu_instances.yaml").read_text())


@pytest.fixture(scope="module")
def catalog() -> dict[str, InstanceType]:
    return load_catalog()


# --------------------------------------------------------------------------- conventions

@pytest.mark.parametrize("price", [1.0, 21.957642, 32.77])
def test_p4d_like_node_gpu_share(price) -> None:
    scad = gpu_share_of_instance("scad", price, **P4D) * 8 / price
    opencost = gpu_share_of_instance("opencost", price, **P4D) * 8 / price
    assert round(scad * 100, 1) == 26.3
    assert round(opencost * 100, 1) == 49.0


def test_scad_formula() -> None:
    c, g, v, m = 21.957642, 8, 96.0, 1152.0
    unit = c / (9 * g + 0.9 * v + 0.1 * m)
    gpu_hr = gpu_share_of_instance("scad", c, g, v, m)
    assert gpu_hr == pytest.approx(9 * unit, rel=1e-14)
    assert g * gpu_hr + v * 0.9 * unit + m * 0.1 * unit == pytest.approx(c, rel=1e-14)  # rates add back to C


@pytest.mark.parametrize("c,g,v,m", [(21.957642, 8, 96.0, 1152.0), (55.04, 8, 192.0, 2048.0), (1.006, 1, 4.0, 16.0)])
def test_opencost_formula_matches_doc(c, g, v, m) -> None:
    ram_multiple = g * (0.95 / 0.004237) + v * (0.031611 / 0.004237) + m
    ram_price = c / ram_multiple
    cpu_price = ram_price * 0.031611 / 0.004237
    gpu_price = ram_price * 0.95 / 0.004237
    assert gpu_share_of_instance("opencost", c, g, v, m) == pytest.approx(gpu_price, rel=1e-14)
    assert g * gpu_price + v * cpu_price + m * ram_price == pytest.approx(c, rel=1e-14)


def test_gpu_only_is_price_over_gpus() -> None:
    assert gpu_share_of_instance("gpu_only", 55.04, 8, 192.0, 2048.0) == pytest.approx(6.88, rel=1e-15)
    assert gpu_share_of_instance("gpu_only", 3.06, 1, 8.0, 61.0) == pytest.approx(3.06, rel=1e-15)


@pytest.mark.parametrize("convention", ["scad", "opencost", "gpu_only"])
def test_no_gpus_means_no_gpu_price(convention) -> None:
    assert gpu_share_of_instance(convention, 10.0, 0, 4.0, 16.0) == 0.0


@pytest.mark.parametrize("convention", ["scad", "opencost", "gpu_only"])
def test_gpu_share_is_linear_in_price_and_bounded(convention) -> None:
    one = gpu_share_of_instance(convention, 1.0, **P4D)
    assert gpu_share_of_instance(convention, 20.0, **P4D) == pytest.approx(20 * one, rel=1e-14)
    assert 0 < 8 * one <= 1.0 + 1e-15


# --------------------------------------------------------------------------- Pricer precedence

CAT = {"p5.48xlarge": InstanceType("p5.48xlarge", 8, H100, 192.0, 2048.0, 55.04)}


def full_config(**over) -> dict:
    cfg = dict(gpu_hour_by_gpu_model={H100: 5.0}, gpu_hour_by_instance_type={"p5.48xlarge": 4.0},
               instance_hour_by_instance_type={"p5.48xlarge": 80.0}, default_gpu_hour=1.0)
    cfg.update(over)
    return cfg


def price(cfg: dict, models=(H100,), itype="p5.48xlarge", gpus=8, vcpus=0.0, mem=0.0, catalog=CAT) -> GpuPrice:
    return Pricer(PricesConfig(**cfg), catalog=catalog).gpu_hour(itype, models, gpus, vcpus, mem)


def test_gpu_model_price_wins() -> None:
    assert price(full_config()) == GpuPrice(5.0, "config:gpu_model")


@pytest.mark.parametrize("models", [
    ("NVIDIA-H100-80GB-HBM3",),  # GFD label form nvidia.com/gpu.product
    ("", "NVIDIA-H100-80GB-HBM3"),  # no DCGM modelName, GFD label only
    ("nvidia h100 80gb hbm3",),
    ("  NVIDIA_H100_80GB_HBM3 ",),
])
def test_gpu_model_matches_gfd_label_form(models) -> None:
    assert price(full_config(), models=models) == GpuPrice(5.0, "config:gpu_model")


def test_gpu_model_configured_in_gfd_form_matches_dcgm_name() -> None:
    cfg = full_config(gpu_hour_by_gpu_model={"NVIDIA-H100-80GB-HBM3": 5.5})
    assert price(cfg) == GpuPrice(5.5, "config:gpu_model")


def test_first_matching_model_name_wins() -> None:
    cfg = full_config(gpu_hour_by_gpu_model={H100: 5.0, "NVIDIA-H100-SXM": 7.0})
    assert price(cfg, models=("NVIDIA-H100-SXM", H100)).per_gpu_hour == 7.0


def test_instance_type_gpu_price_beats_instance_price() -> None:
    assert price(full_config(gpu_hour_by_gpu_model={})) == GpuPrice(4.0, "config:instance_type")
    assert price(full_config(), models=("NVIDIA A10G",)) == GpuPrice(4.0, "config:instance_type")


@pytest.mark.parametrize("split", ["scad", "opencost", "gpu_only"])
def test_configured_instance_price_beats_catalog(split) -> None:
    cfg = full_config(gpu_hour_by_gpu_model={}, gpu_hour_by_instance_type={}, instance_price_split=split)
    want = gpu_share_of_instance(split, 80.0, 8, 192.0, 2048.0)
    got = price(cfg)
    assert got.source == f"config:{split}"
    assert got.per_gpu_hour == pytest.approx(want, rel=1e-15)


@pytest.mark.parametrize("split", ["scad", "opencost", "gpu_only"])
def test_catalog_beats_default(split) -> None:
    cfg = full_config(gpu_hour_by_gpu_model={}, gpu_hour_by_instance_type={}, instance_hour_by_instance_type={},
                      instance_price_split=split)
    got = price(cfg)
    assert got.source == f"catalog:{split}"
    assert got.per_gpu_hour == pytest.approx(gpu_share_of_instance(split, 55.04, 8, 192.0, 2048.0), rel=1e-15)


def test_catalog_specs_win_over_node_figures() -> None:
    cfg = full_config(gpu_hour_by_gpu_model={}, gpu_hour_by_instance_type={}, instance_hour_by_instance_type={},
                      instance_price_split="gpu_only")
    # The node reports 4 GPUs (e.g. two unhealthy); the catalog's 8 GPUs split the instance price.
    assert price(cfg, gpus=4).per_gpu_hour == pytest.approx(55.04 / 8)


def test_configured_instance_price_for_type_outside_catalog_uses_node_figures() -> None:
    cfg = PricesConfig(instance_hour_by_instance_type={"custom.large": 10.0}, instance_price_split="scad")
    got = Pricer(cfg, catalog=CAT).gpu_hour("custom.large", (H100,), 2, 32.0, 256.0)
    assert got.source == "config:scad"
    assert got.per_gpu_hour == pytest.approx(gpu_share_of_instance("scad", 10.0, 2, 32.0, 256.0))
    # Without GPUs the instance price cannot be split: fall through to the default.
    cfg = PricesConfig(instance_hour_by_instance_type={"custom.large": 10.0}, default_gpu_hour=2.5)
    assert Pricer(cfg, catalog=CAT).gpu_hour("custom.large", (H100,), 0) == GpuPrice(2.5, "config:default")


def test_default_gpu_hour_for_unknown_instance() -> None:
    assert price(full_config(gpu_hour_by_gpu_model={}), itype="x9.unknown") == GpuPrice(1.0, "config:default")


def test_unknown_instance_without_default_is_free_with_source_none() -> None:
    assert price({}, itype="x9.unknown", models=("Tesla T4",)) == GpuPrice(0.0, "none")
    assert price({}, itype="", models=("",)) == GpuPrice(0.0, "none")


def test_pricer_uses_shipped_catalog_by_default(catalog) -> None:
    got = Pricer(PricesConfig()).gpu_hour("p4d.24xlarge", ("NVIDIA A100-SXM4-40GB",), 8)
    assert got.source == "catalog:scad"
    assert got.per_gpu_hour == pytest.approx(gpu_share_of_instance("scad", 21.957642, 8, 96.0, 1152.0))
    assert 8 * got.per_gpu_hour / 21.957642 == pytest.approx(0.263, abs=5e-4)


def test_pricer_reads_catalog_path_from_config(tmp_path) -> None:
    path = tmp_path / "cat.yaml"
    path.write_text(yaml.safe_dump({"instances": [
        {"instance_type": "my.gpu", "gpus": 2, "gpu_model": H100, "vcpus": 16, "memory_gib": 64,
         "on_demand_usd_per_hour": 10.0},
        {"instance_type": "no.price", "gpus": 1, "vcpus": 4, "memory_gib": 16, "on_demand_usd_per_hour": None},
    ]}))
    assert set(load_catalog(str(path))) == {"my.gpu"}
    pricer = Pricer(PricesConfig(catalog=str(path), instance_price_split="gpu_only"))
    assert pricer.gpu_hour("my.gpu", (), 2) == GpuPrice(5.0, "catalog:gpu_only")
    assert pricer.gpu_hour("p4d.24xlarge", (), 8) == GpuPrice(0.0, "none")  # shipped catalog replaced


def test_negative_configured_price_is_rejected() -> None:
    with pytest.raises(Exception, match="prices must be >= 0"):
        PricesConfig(gpu_hour_by_gpu_model={H100: -1.0})


# --------------------------------------------------------------------------- shipped catalog

def test_catalog_entries_are_sane(raw, catalog) -> None:
    entries = raw["instances"]
    names = [e["instance_type"] for e in entries]
    assert len(names) == len(set(names)), "duplicate instance_type"
    for e in entries:
        assert e["gpus"] > 0, e["instance_type"]
        assert e["vcpus"] > 0, e["instance_type"]
        assert e["memory_gib"] > 0, e["instance_type"]
        assert e["on_demand_usd_per_hour"] is not None and e["on_demand_usd_per_hour"] > 0, e["instance_type"]
        assert e.get("gpu_model"), e["instance_type"]
    assert set(catalog) == set(names)  # nothing silently dropped by load_catalog


def test_catalog_source_block(raw) -> None:
    src = raw["source"]
    assert src["retrieved"]
    assert src["documents"] and all(d.get("url") and d.get("title") for d in src["documents"])
    assert raw.get("currency") == "USD"


def test_catalog_covers_documented_families(catalog) -> None:
    families = {name.split(".")[0] for name in catalog}
    for fam in ("p3", "p4d", "p4de", "p5", "p5e", "p5en", "g4dn", "g5", "g6", "g6e"):
        assert fam in families, fam


def test_p4d(catalog) -> None:
    p4d = catalog["p4d.24xlarge"]
    assert (p4d.gpus, p4d.vcpus, p4d.memory_gib) == (8, 96.0, 1152.0)
    assert p4d.gpu_model == "NVIDIA A100-SXM4-40GB"
    assert p4d.usd_per_hour > 0


# --------------------------------------------------------------------------- capacity types

def _node(config: PricesConfig, capacity: str, itype: str = "p4d.24xlarge", models=("NVIDIA A100-SXM4-40GB",)):
    return Pricer(config).node_price(itype, models, capacity, 8, 96.0, 1152.0)


def test_capacity_type_rates_and_sources(catalog) -> None:
    od = catalog["p4d.24xlarge"].usd_per_hour
    cfg = PricesConfig(capacity_types={"spot": {"discount": 0.7},
                                       "reserved": {"instance_hour_by_instance_type": {"p4d.24xlarge": 15.0}},
                                       "on_demand": {"discount": 0.2}})
    spot = _node(cfg, "spot")
    assert spot.instance_hour == pytest.approx(od * 0.3) and spot.instance_source == "catalog"
    assert spot.per_gpu("scad").source == "catalog:scad+spot_discount"
    assert _node(cfg, "on-demand").per_gpu("opencost").source == "catalog:opencost+on_demand_discount"
    assert _node(cfg, "unknown").instance_hour == pytest.approx(od * 0.8)  # no label: on-demand rate
    reserved = _node(cfg, "reserved")
    assert reserved.instance_hour == 15.0 and reserved.per_gpu("scad").source == "config:reserved.instance:scad"
    rates, source = reserved.scad_rates()
    assert source == "config:reserved.instance:scad"
    assert 8 * rates[0] + 96 * rates[1] + 1152 * rates[2] == pytest.approx(15.0, rel=1e-12)


def test_capacity_type_own_gpu_price_beats_discount_and_on_demand_explicit_price() -> None:
    cfg = PricesConfig(gpu_hour_by_gpu_model={"NVIDIA A100-SXM4-40GB": 4.0},
                       capacity_types={"spot": {"discount": 0.5, "gpu_hour_by_gpu_model": {"nvidia a100 sxm4 40gb": 1.1}}})
    assert _node(cfg, "spot").per_gpu("scad") == GpuPrice(1.1, "config:spot.gpu_model")
    assert _node(cfg, "reserved").per_gpu("scad") == GpuPrice(4.0, "config:gpu_model")
    cfg = PricesConfig(gpu_hour_by_gpu_model={"NVIDIA A100-SXM4-40GB": 4.0}, capacity_types={"spot": {"discount": 0.5}})
    assert _node(cfg, "spot").per_gpu("scad") == GpuPrice(2.0, "config:gpu_model+spot_discount")


def test_default_price_is_discounted_too() -> None:
    cfg = PricesConfig(default_gpu_hour=2.0, capacity_types={"spot": {"discount": 0.25}})
    assert _node(cfg, "spot", itype="x9.unknown").per_gpu("scad") == GpuPrice(1.5, "config:default+spot_discount")
    assert _node(PricesConfig(), "spot", itype="x9.unknown").per_gpu("scad") == GpuPrice(0.0, "none")


# --------------------------------------------------------------------------- price file

def test_price_file_is_reread_when_it_changes(tmp_path) -> None:
    import os

    from otelgpu.errors import ConfigError

    path = tmp_path / "prices.yaml"
    path.write_text("gpu_hour_by_instance_type: {p4d.24xlarge: 3.0}\n")
    pricer = Pricer(PricesConfig(file=str(path), gpu_hour_by_instance_type={"p4d.24xlarge": 1.0}))
    assert pricer.reload_if_changed() is True and pricer.reload_if_changed() is False
    assert _price_of(pricer) == 3.0
    path.write_text("gpu_hour_by_instance_type: {p4d.24xlarge: -2}\n")
    os.utime(path, ns=(1, 1))
    with pytest.raises(ConfigError, match=r"prices.yaml: gpu_hour_by_instance_type: prices must be >= 0"):
        pricer.reload_if_changed()
    assert _price_of(pricer) == 3.0  # the bad file changed nothing
    assert pricer.reload_if_changed() is False  # reported once per change
    path.write_text("file: other.yaml\n")
    os.utime(path, ns=(2, 2))
    with pytest.raises(ConfigError, match="main configuration only"):
        pricer.reload_if_changed()


def _price_of(pricer: Pricer) -> float:
    return pricer.node_price("p4d.24xlarge", (), "on-demand", 8).per_gpu("scad").per_gpu_hour


def test_a_capacity_types_own_instance_price_beats_discounted_on_demand_gpu_prices() -> None:
    cfg = PricesConfig(gpu_hour_by_instance_type={"p4d.24xlarge": 4.0},
                       capacity_types={"spot": {"discount": 0.5, "instance_hour_by_instance_type": {"p4d.24xlarge": 12.0}}})
    spot = _node(cfg, "spot").per_gpu("gpu_only")
    assert spot == GpuPrice(1.5, "config:spot.instance:gpu_only")
    assert _node(cfg, "on-demand").per_gpu("gpu_only") == GpuPrice(4.0, "config:instance_type")


def test_a_missing_price_file_is_reported_once(tmp_path) -> None:
    from otelgpu.errors import ConfigError

    pricer = Pricer(PricesConfig(file=str(tmp_path / "absent.yaml")))
    with pytest.raises(ConfigError, match="cannot read"):
        pricer.reload_if_changed()
    assert pricer.reload_if_changed() is False
    (tmp_path / "absent.yaml").write_text("default_gpu_hour: 2.5\n")
    assert pricer.reload_if_changed() is True
    assert pricer.node_price("x", (), "on-demand", 1).per_gpu("scad") == GpuPrice(2.5, "config:default")


def test_an_instances_own_rate_beats_every_other_price_of_its_node() -> None:
    cfg = PricesConfig(gpu_hour_by_gpu_model={"NVIDIA A100-SXM4-40GB": 4.0},
                       instance_hour_by_instance_type={"p4d.24xlarge": 30.0},
                       instance_hour_by_instance_id={"i-0abc": 13.5},
                       capacity_types={"spot": {"discount": 0.5, "gpu_hour_by_gpu_model": {"NVIDIA A100-SXM4-40GB": 1.0}}})
    pricer = Pricer(cfg)
    for capacity_type in ("on-demand", "spot"):
        own = pricer.node_price("p4d.24xlarge", ("NVIDIA A100-SXM4-40GB",), capacity_type, 8, instance_id="i-0abc")
        assert own.instance_hour == 13.5 and own.per_gpu("gpu_only") == GpuPrice(13.5 / 8, "config:instance_id:gpu_only")
        rates, source = own.scad_rates()
        assert source == "config:instance_id:scad" and 8 * rates[0] + 96 * rates[1] + 1152 * rates[2] == pytest.approx(13.5)
    other = pricer.node_price("p4d.24xlarge", ("NVIDIA A100-SXM4-40GB",), "on-demand", 8, instance_id="i-0other")
    assert other.per_gpu("scad") == GpuPrice(4.0, "config:gpu_model")  # another instance: the usual order
    assert pricer.prices_instance("m5.large", "on-demand", "i-0abc") and not pricer.prices_instance("x9.none", "on-demand")
    with pytest.raises(ValueError, match=">= 0"):
        PricesConfig(instance_hour_by_instance_id={"i-0abc": -1.0})
