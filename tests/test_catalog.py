"""GPU and cloud catalogs: names, aliases, figures, zones, prices and egress classes."""

import pytest

from sailor import catalog
from sailor.catalog import Link, LinkClass
from sailor.core.errors import SailorInputError

EXPECTED_GPUS = {"V100-16", "V100-32", "A100-40", "A100-80", "A100-80-PCIe", "H100-80", "H100-PCIe", "H100-NVL",
                 "H200-141", "GH200-96", "GB200-186", "GB300-279", "L4", "T4", "RTX-3090", "RTX-2080", "Titan-RTX", "cpu"}


def test_catalog_lists_exactly_the_issue_gpus():
    assert set(catalog.gpu_names()) == EXPECTED_GPUS


def test_gh96_is_an_alias_of_gh200():
    assert catalog.canonical_gpu("GH-96") == "GH200-96"
    assert catalog.gpu("GH-96") is catalog.gpu("GH200-96")
    assert catalog.gpu("GH-96").gpus_per_node == 4  # Alps Clariden nodes


def test_datasheet_figures_are_dense_and_in_si_units():
    a100 = catalog.gpu("A100-40")
    assert a100.memory_bytes == 40 * 2**30
    assert a100.peak("fp32") == 19.5e12
    assert a100.peak("bf16") == 312e12  # dense, not the 624 sparse figure
    h100 = catalog.gpu("H100-80")
    assert h100.peak("bf16") == 989.5e12  # half of the 1,979 sparse figure
    assert catalog.gpu("H200-141").memory_bytes == 141e9
    assert catalog.gpu("V100-16").hbm_bytes_per_s == 900e9
    # variants the published datasets use (issue 12)
    assert catalog.gpu("V100-32").memory_bytes == 32 * 2**30 and catalog.gpu("V100-32").peak("fp16") == 125e12
    assert catalog.gpu("H100-PCIE").peak("bf16") == 756.5e12 and catalog.gpu("H100-PCIe").hbm_bytes_per_s == 2.0e12
    assert catalog.gpu("H100-NVL").memory_bytes == 94e9 and catalog.gpu("H100-NVL").peak("bf16") == 835.5e12
    assert catalog.gpu("A100-80-PCIe").hbm_bytes_per_s == 1935e9 and catalog.gpu("A100-80-PCIe").efficiency.matmul == 0.811


def test_blackwell_rack_gpus_are_the_nvl72_figures_per_gpu():
    # NVIDIA's NVL72 pages give rack totals for 72 GPUs: 360 PFLOPS BF16 with sparsity, 576 TB/s HBM,
    # 130 TB/s NVLink; 13.4 TB (GB200) and 20 TB (GB300) of HBM3e (gpus.yaml)
    for name, rack_hbm in (("GB200", 13.4e12), ("GB300", 20e12)):
        g = catalog.gpu(name)
        assert g.peak("bf16") == g.peak("fp16") == 360e15 / 72 / 2  # dense: half the sparse figure
        assert g.hbm_bytes_per_s == 576e12 / 72
        assert g.intra_node_bytes_per_s == pytest.approx(130e12 / 72, rel=0.02)  # 1.8 TB/s per GPU
        assert abs(g.memory_bytes - rack_hbm / 72) / g.memory_bytes < 0.005
        assert g.gpus_per_node == 4  # a compute tray: 2 superchips of 2 GPUs
        defaults = catalog._load_yaml("gpus.yaml")["efficiency_defaults"]
        assert g.efficiency == catalog.Efficiency(**defaults)  # nothing measured on Blackwell


def test_missing_dtype_falls_back_to_fp32():
    assert catalog.gpu("V100-16").peak("bf16") == catalog.gpu("V100-16").peak("fp32") == 15.7e12
    assert catalog.gpu("T4").peak("bf16") == 8.1e12


def test_every_gpu_has_positive_figures():
    for name in catalog.gpu_names():
        g = catalog.gpu(name)
        assert g.memory_bytes > 0 and g.hbm_bytes_per_s > 0 and g.gpus_per_node >= 1
        assert g.peak("fp32") > 0 and g.framework_bytes > 0


def test_unknown_gpu_suggests_the_closest():
    with pytest.raises(SailorInputError, match=r"unknown GPU type 'A100-41'.*did you mean 'A100-40'"):
        catalog.gpu("A100-41")


def test_zones_regions_and_link_classes():
    gcp = catalog.provider("gcp")
    assert gcp.region("us-central1-b") == "us-central1"
    assert gcp.link_class("us-central1-a", "us-central1-a") is LinkClass.SAME_ZONE
    assert gcp.link_class("us-central1-a", "us-central1-f") is LinkClass.SAME_REGION
    assert gcp.link_class("us-central1-a", "us-west1-b") is LinkClass.SAME_CONTINENT
    assert gcp.link_class("us-central1-a", "europe-west4-a") is LinkClass.INTERCONTINENTAL


def test_unknown_zone_raises_with_hint():
    with pytest.raises(SailorInputError, match=r"unknown gcp zone 'us-central1-z'.*did you mean"):
        catalog.provider("gcp").region("us-central1-z")


def test_prices_and_egress_match_the_paper():
    assert catalog.list_price("gcp", "A100-40") == 3.673385
    assert catalog.list_price("gcp", "V100-16") == 2.859998
    assert catalog.list_price("gcp", "GH-96") == 11.06
    egress = catalog.provider("gcp").egress_usd_per_gb
    assert egress[LinkClass.SAME_ZONE] == 0.0
    assert egress[LinkClass.SAME_REGION] == 0.01  # communication_cost.json: zones of us-central1
    assert egress[LinkClass.SAME_CONTINENT] == 0.02  # us-central1 <-> us-west1
    assert egress[LinkClass.INTERCONTINENTAL] > egress[LinkClass.SAME_CONTINENT]


def test_missing_price_is_an_error_not_zero():
    with pytest.raises(SailorInputError, match="no list price for GPU type 'RTX-3090'"):
        catalog.list_price("gcp", "RTX-3090")


def test_unknown_provider():
    with pytest.raises(SailorInputError, match="unknown provider 'ibm'"):
        catalog.provider("ibm")


def test_link_time_is_alpha_plus_bytes_over_beta():
    link = Link(latency_s=0.5, bandwidth_bytes_per_s=1e6)
    assert link.time_s(2e6) == pytest.approx(2.5)
    assert link.time_s(0) == 0.0
    # flows share the NIC; with a per-flow cap, few flows cannot fill it
    assert link.time_s(2e6, flows=4) == pytest.approx(0.5 + 8.0)
    capped = Link(latency_s=0.0, bandwidth_bytes_per_s=4e6, flow_bandwidth_bytes_per_s=1e6)
    assert capped.time_s(1e6) == pytest.approx(1.0)
    assert capped.time_s(1e6, flows=2) == pytest.approx(1.0)
    assert capped.time_s(1e6, flows=8) == pytest.approx(2.0)


def test_slower_link_classes_are_never_faster():
    # inside a region the measured links between zones equal those inside a zone; beyond, slower
    links = catalog.provider("gcp").links
    order = [LinkClass.SAME_ZONE, LinkClass.SAME_REGION, LinkClass.SAME_CONTINENT, LinkClass.INTERCONTINENTAL]
    for near, far in zip(order, order[1:]):
        for flows in (1, 4):
            assert links[far].time_s(1e8, flows) >= links[near].time_s(1e8, flows)
    assert links[LinkClass.SAME_CONTINENT].time_s(1e8) > links[LinkClass.SAME_REGION].time_s(1e8)
