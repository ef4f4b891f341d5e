"""The catalog beyond one cloud: GCP's GPU regions, AWS and Azure with per-region prices, clusters that
span providers (classes, links and egress across them, hand-computed), and SkyPilot's `infra:` of
each group on its own provider."""

from __future__ import annotations

import pytest
import yaml
from test_planner_geo import (
    ACT_BYTES,
    ALPHA_CROSS,
    BETA_CROSS,
    C_CROSS,
    C_ZONE,
    pipeline_time,
)
from test_planner_geo import _ctx as geo_ctx

from sailor import catalog
from sailor.catalog import Link, LinkClass
from sailor.core.errors import SailorInputError
from sailor.launch import Backend, launch_files, launch_specs
from sailor.launch.common import LaunchOptions
from sailor.launch.skypilot import SkyPilotOptions
from sailor.perf.network import NetworkModel
from sailor.plan import plan_from_dict
from sailor.planner import PlanOptions, plan_job
from sailor.runtime.command import WorkerSettings
from sailor.specs import load_cluster
from sailor.specs.cluster import ClusterSpec

# The zones of the first catalog (gcp.yaml before it held every GPU region): all still there.
OLD_GCP_ZONES = {"us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "us-west1-a", "us-west1-b",
                 "us-east1-b", "us-east1-c", "us-east1-d", "us-east4-a", "us-east4-b", "us-east4-c", "europe-west4-a",
                 "europe-west4-b", "europe-west4-c", "asia-east1-a", "asia-east1-b", "asia-east1-c"}


def test_providers_regions_and_zones_are_counted_and_unique():
    counts = {p: (len(catalog.provider(p).region_continent), len(catalog.provider(p).zone_region))
              for p in ("gcp", "aws", "azure")}
    assert counts == {"gcp": (32, 97), "aws": (13, 43), "azure": (8, 8)}
    assert set(catalog.provider_names()) == {"gcp", "aws", "azure", "local"}
    assert OLD_GCP_ZONES <= set(catalog.provider("gcp").zone_region)
    zones = [z for p in catalog.provider_names() for z in catalog.provider(p).zone_region]
    assert len(zones) == len(set(zones)) == len(catalog.known_zones())  # a zone names its provider
    assert catalog.zone_provider("us-east-1a") == "aws" and catalog.zone_provider("eastus") == "azure"
    assert catalog.zone_provider("us-east4-a") == "gcp" and catalog.zone_provider("mars-1a") is None


def test_gcp_keeps_its_prices_and_lists_the_zones_of_each_gpu():
    gcp = catalog.provider("gcp")
    assert gcp.price("asia-south1-c", "A100-40") == gcp.price("us-central1-a", "A100-40") == 3.673385  # flat
    assert gcp.offers("us-east5-a", "A100-80") is True  # a2-ultragpu there
    assert gcp.offers("us-west1-a", "A100-40") is False  # a2-highgpu only in us-west1-b
    assert gcp.offers("europe-west2-b", "H100-80") is True  # a3-edgegpu
    assert gcp.offers("us-east1-c", "V100-16") is True and gcp.offers("us-east1-b", "V100-16") is False  # N1 GPU rows
    assert gcp.offers("us-west1-a", "GH200-96") is None  # no per-zone list: unknown


def test_aws_and_azure_price_per_region_as_instance_price_over_gpus():
    aws, azure = catalog.provider("aws"), catalog.provider("azure")
    assert aws.price("us-east-1c", "A100-40") == pytest.approx(32.7726 / 8)  # p4d.24xlarge
    assert aws.price("us-west-2d", "H100-80") == pytest.approx(98.32 / 8)  # p5.48xlarge
    assert aws.price("eu-west-2a", "H100-80") == pytest.approx(127.816 / 8)  # dearer in London
    assert aws.price("us-west-1a", "A100-40") is None and aws.offers("us-west-1a", "A100-40") is False
    assert azure.price("eastus", "A100-40") == pytest.approx(27.197 / 8)  # ND96asr_v4
    assert azure.price("westus", "H100-80") == pytest.approx(127.816 / 8)  # ND96isr_H100_v5
    assert azure.price("eastus", "H100-NVL") == 6.98 and azure.price("northcentralus", "A100-40") is None
    c = ClusterSpec(provider="aws", zones={"us-east-1a": {"H100-80": 8}})
    assert c.price("us-east-1a", "H100-80") == pytest.approx(12.29) and c.prov is aws
    assert ClusterSpec(provider="aws", zones={"us-east-1a": {"A100-40": 8}}, prices={"A100-40": 5.0}).price(
        "us-east-1a", "A100-40") == 5.0  # the spec's own price wins


# us-west-1 (N. California) prices only p5 (H100-80): no A100-40 there; the nearest regions that have it
NO_A100_AWS = ("aws does not offer A100-40 in zone 'us-west-1a' (it offers H100-80 there) (use a zone that does, e.g."
               " us-east-1a, us-east-2a, us-west-2a; or, if yours does, give its price there under"
               " prices.us-west-1a.A100-40)")


@pytest.mark.parametrize("prices", [{}, {"A100-40": 5.0}])
def test_a_gpu_type_the_zone_does_not_offer_is_refused(prices):
    # it was planned without a word (a flat price, which reads as a price list, made it pass on aws too)
    with pytest.raises(SailorInputError) as e:
        load_cluster({"provider": "aws", "zones": {"us-west-1a": {"A100-40": 8}}, "prices": prices})
    assert str(e.value) == f"zones.us-west-1a.A100-40: {NO_A100_AWS}"
    # gcp lists the zones of each type: europe-west1-b has no a2-highgpu machines; its region's
    # zones come first, then its continent's, one zone per region
    with pytest.raises(SailorInputError) as e:
        load_cluster({"provider": ["gcp", "aws"],
                      "zones": {"europe-west1-b": {"A100-40": 8}, "us-east-1a": {"V100-16": 8}}})
    assert str(e.value) == (
        "zones.europe-west1-b.A100-40: gcp does not offer A100-40 in zone 'europe-west1-b' (it offers H100-80,"
        " H200-141, L4, T4 there) (use a zone that does, e.g. europe-west4-a, asia-northeast1-a, asia-northeast3-a;"
        " or, if yours does, give its price there under prices.europe-west1-b.A100-40)")
    with pytest.raises(SailorInputError, match=r"zones\.us-central1-a\.H200-141: gcp does not offer H200-141 in"
                                               r" zone 'us-central1-a' .*e\.g\. us-central1-b, "):
        load_cluster({"zones": {"us-central1-a": {"H200-141": 8}}})


def test_a_price_in_the_zone_says_it_offers_the_type_after_all():
    # the catalog may lag what a zone rents: the user's own price for the zone is taken as its word
    c = load_cluster({"provider": "aws", "zones": {"us-west-1a": {"A100-40": 8}},
                      "prices": {"us-west-1a": {"A100-40": 5.5}}})
    assert c.price("us-west-1a", "A100-40") == 5.5
    # a type the catalog has no zone list for (GH200-96 on gcp) may be anywhere; 0 GPUs ask nothing
    anywhere = load_cluster({"zones": {"us-west1-a": {"GH200-96": 8, "A100-40": 0}}})
    assert anywhere.price("us-west1-a", "GH200-96") == 11.06
    gcp = catalog.provider("gcp")
    assert gcp.offered_in("us-south1-a") == [] and gcp.zones_offering("A100-80") == [
        "asia-southeast1-c", "europe-west4-a", "us-central1-a", "us-central1-c", "us-east4-c", "us-east5-a",
        "us-east5-b"]


def test_cluster_provider_field():
    assert ClusterSpec(zones={"us-central1-a": {"A100-40": 4}}).to_dict()["provider"] == "gcp"  # default unchanged
    assert ClusterSpec(provider=["aws"], zones={}).provider == "aws"  # a list of one is that name
    multi = ClusterSpec(provider=["gcp", "aws"], zones={"us-east1-b": {"A100-40": 8}, "us-east-1a": {"A100-40": 8}})
    assert multi.providers == ("gcp", "aws") and multi.prov.name == "gcp+aws"
    again = load_cluster(yaml.safe_load(yaml.safe_dump(multi.to_dict())))  # a plan file carries it
    assert again.providers == ("gcp", "aws") and again.zones == multi.zones
    with pytest.raises(SailorInputError, match=r"zones\.us-east-1a: 'us-east-1a' is a zone of provider aws, which this"
                                               r" cluster does not name"):
        load_cluster({"zones": {"us-east-1a": {"A100-40": 8}}})
    with pytest.raises(SailorInputError, match=r"provider: unknown provider 'ibm'"):
        load_cluster({"provider": "ibm", "zones": {}})
    with pytest.raises(SailorInputError, match="provider local .* cannot be combined with a cloud"):
        load_cluster({"provider": ["gcp", "local"], "zones": {}})
    with pytest.raises(SailorInputError, match="providers must be distinct"):
        load_cluster({"provider": ["gcp", "gcp"], "zones": {}})


def test_link_classes_and_egress_across_providers():
    prov = catalog.clouds(["gcp", "aws", "azure"])
    assert prov.link_class("us-east4-a", "us-east-1a") is LinkClass.SAME_CONTINENT  # Virginia, two clouds
    assert prov.link_class("europe-west4-a", "us-east-1a") is LinkClass.INTERCONTINENTAL
    assert prov.link_class("us-east-1a", "us-east-1b") is LinkClass.SAME_REGION  # inside AWS: AWS's classes
    assert prov.link_class("eastus", "eastus") is LinkClass.SAME_ZONE
    sc = LinkClass.SAME_CONTINENT
    # across providers the sender pays its internet egress; inside one, its own class price
    assert prov.egress_between("us-east4-a", "us-east-1a", sc) == 0.12  # GCP premium tier
    assert prov.egress_between("us-east-1a", "us-east4-a", sc) == 0.09  # AWS to the internet
    assert prov.egress_between("eastus", "us-east-1a", sc) == 0.0875  # Azure
    assert prov.egress_between("us-east-1a", "us-west-2a", sc) == 0.02  # AWS inter-region
    assert prov.egress_between("us-east4-a", "us-central1-a", sc) == 0.02  # GCP inter-region


def test_default_links_across_providers_take_the_cross_provider_link():
    cluster = ClusterSpec(provider=["gcp", "aws"], zones={})
    net = NetworkModel(cluster=cluster)
    x = 1e8
    # GCP Virginia -> AWS Virginia: clouds.yaml same_continent, 17.5 ms + x / 0.37 GB/s for one flow
    assert net.p2p_time_s("us-east4-a", "A100-40", "us-east-1a", "A100-40", x) == pytest.approx(17.5e-3 + x / 0.37e9)
    # four flows share the 0.7 GB/s NIC: 17.5 ms + 4x / 0.7 GB/s
    assert net.transfer_time_s("us-east4-a", "A100-40", "us-east-1a", "A100-40", x, flows=4) == pytest.approx(
        17.5e-3 + 4 * x / 0.7e9)
    assert net.p2p_time_s("europe-west4-a", "A100-40", "us-east-1a", "A100-40", x) == pytest.approx(60e-3 + x / 0.1e9)
    assert net.p2p_time_s("us-east-1a", "A100-40", "us-east-1b", "A100-40", x) == pytest.approx(0.15e-3 + x / 1.3e9)
    assert cluster.link(LinkClass.SAME_CONTINENT, "us-east4-a", "us-east-1a") == Link(17.5e-3, 0.7e9, 0.37e9)


# ---- a plan across two providers, hand-computed (the setting of test_planner_geo.py) ----------------
ZG, ZA = "us-east4-a", "us-east-1a"  # GCP and AWS, both in Virginia: same_continent across providers
GCP_OUT, AWS_OUT = 0.12, 0.09  # $/GB each provider charges for bytes leaving it
V100_GCP, V100_AWS = 2.859998, 24.48 / 8  # GCP's list price, AWS us-east-1 p3.16xlarge / 8


def _ctx(global_batch: int, per_zone: int):
    """test_planner_geo.py's model, layer times and links (its same_continent class holds across
    clouds too), with one zone in GCP and one in AWS."""
    return geo_ctx(global_batch, {ZG: {"V100-16": per_zone}, ZA: {"V100-16": per_zone}}, provider=["gcp", "aws"])


def test_a_pipeline_across_two_providers_pays_each_senders_internet_egress():
    ctx = _ctx(4, 1)
    r = plan_job(ctx, PlanOptions(max_mbs=1, schedules=False))
    plan, est = r.plan, r.estimate
    assert plan.stages == ((0, 2), (2, 4)) and {x.zone for x in plan.pipelines[0].replicas} == {ZG, ZA}
    assert est.iteration_time_s == pytest.approx(pipeline_time(4, C_CROSS), rel=1e-9)  # 33.3 s
    # 4 micro-batches, each an activation one way and its gradient back: 50,331,648 bytes each way;
    # the GCP side sends its half at $0.12/GB, the AWS side at $0.09/GB: $0.0105696 per iteration
    one_way = ACT_BYTES * 4
    assert est.cross_zone_bytes == pytest.approx(2 * one_way, rel=1e-9)
    egress = one_way / 1e9 * (GCP_OUT + AWS_OUT)
    assert egress == pytest.approx(0.010569646, rel=1e-6)
    assert est.egress_per_iteration_usd == pytest.approx(egress, rel=1e-9)
    rate = V100_GCP + V100_AWS  # $/hour of the two GPUs, each at its provider's price
    assert est.cost_per_iteration_usd == pytest.approx(rate * est.iteration_time_s / 3600 + egress, rel=1e-9)


def test_data_parallelism_across_two_providers_rings_through_both_egress_prices():
    ctx = _ctx(64, 2)
    r = plan_job(ctx, PlanOptions(max_mbs=1, schedules=False))
    plan, est = r.plan, r.estimate
    # one pipeline per provider, stages all-reduced across them (test_planner_geo.py's case, where it
    # wins): a ring of two replicas, 2 steps of half the gradient, each alpha + bytes / beta
    assert len(plan.pipelines) == 2 and all(len({x.zone for x in p.replicas}) == 1 for p in plan.pipelines)
    assert {p.replicas[0].zone for p in plan.pipelines} == {ZG, ZA}
    sync = max(2 * (ALPHA_CROSS + ctx.stage_params(1, a, e) * 4 / 2 / BETA_CROSS) for a, e in plan.stages)
    assert est.iteration_time_s == pytest.approx(pipeline_time(32, C_ZONE) + sync, rel=1e-9)
    # both ring edges carry the whole stage gradient (2(D-1)/D = 1): GCP -> AWS at $0.12/GB, AWS -> GCP at $0.09/GB
    egress = sum(ctx.stage_params(1, a, e) * 4 / 1e9 * (GCP_OUT + AWS_OUT) for a, e in plan.stages)
    assert est.egress_per_iteration_usd == pytest.approx(egress, rel=1e-9)


# ---- SkyPilot: each group on its own provider ---------------------------------------------------
def _rep(stage: int, gpu: str, zone: str, tp: int) -> dict:
    return {"stage": stage, "gpu": gpu, "zone": zone, "tp": tp}


def test_skypilot_places_each_group_on_its_provider():
    zones = {"us-central1-a": {"A100-40": 16}, "us-east-1a": {"A100-40": 8}, "eastus": {"V100-32": 8}}
    plan = plan_from_dict({"micro_batch_size": 1, "stages": [[0, 10], [10, 26]], "pipelines": [
        {"microbatches": 4, "replicas": [_rep(0, "A100-40", "us-central1-a", 8), _rep(1, "A100-40", "us-east-1a", 8)]},
        {"microbatches": 4, "replicas": [_rep(0, "A100-40", "us-central1-a", 8), _rep(1, "V100-32", "eastus", 8)]},
    ], "job": {"model": "opt-350m", "global_batch_size": 8},
        "cluster": {"provider": ["gcp", "aws", "azure"], "zones": zones}})
    opts = LaunchOptions(worker=WorkerSettings(plan="plan.json", steps=3, device="cuda"), python="python3")
    docs = launch_specs(plan, Backend.SKYPILOT, opts, sky=SkyPilotOptions(workdir="/w"))
    placed = sorted((t["resources"]["infra"], t["resources"]["accelerators"], t["num_nodes"]) for t in docs)
    assert placed == [("aws/us-east-1/us-east-1a", "A100:8", 1), ("azure/eastus", "V100-32GB:8", 1),
                      ("gcp/us-central1/us-central1-a", "A100:8", 2)]
    # launch.sh says the clouds' networks must be joined for the groups to meet
    script = launch_files(plan, Backend.SKYPILOT, opts, sky=SkyPilotOptions(workdir="/w"), image="example.com/s:1")["launch.sh"]
    assert "# this plan spans aws, azure, gcp: the groups reach rank 0's internal address only if" in script
