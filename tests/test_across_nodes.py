"""Lesson 06b's mechanisms on forked ranks: groups per node, the hierarchical all-reduce equal to dist.all_reduce and
the bytes each level carries, the cost model (and that a model using the inside link across nodes fails its
check), each parallelism's bytes per step, local SGD; the lab on one host and on emulated nodes."""

import pytest

from labsrc.core.forked import run_ranks
from labsrc.core.world import RequestError
from labsrc.lessons.across_nodes import analysis, cost_model as model, hierarchy, lab, traffic
from labsrc.lessons.async_parameter_server.server import Problem
from labsrc.techniques.alpha_beta import AlphaBeta, ring_allreduce_time_s

LAYOUTS = [(2, 2), (4, 1), (1, 2), (2, 3), (3, 2)]


def _hierarchical(ctx, nodes, per_node, sizes):
    topology = hierarchy.Topology(nodes, per_node)
    groups = hierarchy.make_groups(ctx.rank, topology)
    return groups.inside_ranks, groups.across_ranks, hierarchy.check_hierarchical(ctx.rank, groups, sizes)


@pytest.mark.parametrize("nodes, per_node", LAYOUTS)
def test_hierarchical_all_reduce_equals_dist_all_reduce_and_sends_one_shard_across(nodes, per_node):
    sizes = [1, per_node + 1, 1000, 4099]
    for rank, (inside, across, rows) in enumerate(run_ranks(_hierarchical, nodes * per_node,
                                                            args=(nodes, per_node, sizes))):
        assert inside == list(range(rank // per_node * per_node, (rank // per_node + 1) * per_node))
        assert across == [node * per_node + rank % per_node for node in range(nodes)]
        for row in rows:
            assert row["max_error"] == 0.0, row
            shard = -(-row["size"] // per_node)
            assert row["across_bytes"] == (4 * shard if nodes > 1 else 0)
            assert row["inside_bytes"] == (2 * 4 * shard * per_node if per_node > 1 else 0)


def test_payload_through_a_node_link():
    """flat: one ring edge leaves each node, 2(n-1) steps of nbytes/n; hierarchical: 2(N-1)/N nbytes of shards."""
    assert model.link_payload_bytes("flat", 1e6, hierarchy.Topology(2, 2)) == pytest.approx(1.5e6)
    assert model.link_payload_bytes("flat", 1e6, hierarchy.Topology(4, 1)) == pytest.approx(1.5e6)
    assert model.link_payload_bytes("hierarchical", 1e6, hierarchy.Topology(2, 2)) == pytest.approx(1e6)
    assert model.link_payload_bytes("hierarchical", 1e6, hierarchy.Topology(4, 8)) == pytest.approx(1.5e6)


def test_interface_counter_reads_this_namespace(monkeypatch):
    assert hierarchy.interface_sent_bytes("lo") >= 0
    with pytest.raises(ValueError, match="no interface"):
        hierarchy.interface_sent_bytes("no-such-interface")
    monkeypatch.delenv("LABSRC_NODE_ADDRESS", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert hierarchy.node_interface() is None, "on one host the loopback counts both levels: nothing to read"


def test_topology_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    topology = hierarchy.Topology.from_environment(4)
    assert (topology.nodes, topology.ranks_per_node, topology.node_of(3)) == (2, 2, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="whole nodes"):
        hierarchy.Topology.from_environment(4)


SLOW = AlphaBeta(50e-6, 1 / 12.5e6, 1.0)  # 100 Mbit/s, 50 us
FAST = AlphaBeta(20e-6, 1 / 2e9, 1.0)  # loopback-like


def test_flat_ring_over_nodes_is_the_ring_formula_on_the_slow_link():
    topology = hierarchy.Topology(2, 2)
    assert model.flat_ring_time_s(1e6, topology, FAST, SLOW) == pytest.approx(ring_allreduce_time_s(1e6, 4, SLOW))
    one_node = hierarchy.Topology(1, 4)
    assert model.flat_ring_time_s(1e6, one_node, FAST, SLOW) == pytest.approx(ring_allreduce_time_s(1e6, 4, FAST))


@pytest.mark.parametrize("nodes, per_node", [(2, 2), (2, 8), (4, 2), (8, 1)])
def test_hierarchical_speedup_tends_to_its_limit(nodes, per_node):
    link = AlphaBeta(0.0, SLOW.beta_s_per_byte, 1.0)
    limit = (nodes * per_node - 1) / (per_node * (nodes - 1))
    topology = hierarchy.Topology(nodes, per_node)
    assert model.predicted_speedup(1e9, topology, AlphaBeta(0.0, 1e-15, 1.0), link) == pytest.approx(limit, rel=1e-4)


def test_lesson06_model_is_the_flat_ring_and_the_node_count_model_is_not():
    """Lesson 06 models NCCL's flat ring: 2(n-1)/n nbytes through each node link. On 2 nodes of 2 ranks charging
    2(N-1)/N instead (node_count_time_s) is a third too fast; with one rank per node the two agree."""
    big, two_by_two = 64e6, hierarchy.Topology(2, 2)
    flat = model.flat_ring_time_s(big, two_by_two, FAST, SLOW)
    assert model.lesson06_time_s(big, two_by_two, FAST, SLOW) == pytest.approx(flat, rel=0.05)
    assert model.node_count_time_s(big, two_by_two, FAST, SLOW) == pytest.approx(flat / 1.5, rel=1e-3)
    assert not model.judge(flat, model.node_count_time_s(big, two_by_two, FAST, SLOW))
    assert model.lesson06_time_s(big, hierarchy.Topology(4, 1), None, SLOW) == pytest.approx(
        model.flat_ring_time_s(big, hierarchy.Topology(4, 1), None, SLOW), rel=0.05)


def test_the_model_is_judged_where_the_shapers_credit_is_small():
    """Judged where a shaped link's credit (burst + one offloaded packet) is at most 10% of what crosses it."""
    two_by_two = hierarchy.Topology(2, 2)
    sizes = (124928, 499712, 999424)  # the lab's sweep at 100 Mbit/s
    assert [model.model_holds("flat", s, two_by_two) for s in sizes] == [False, True, True]
    assert [model.model_holds("hierarchical", s, two_by_two) for s in sizes] == [False, False, True]
    assert model.model_holds("flat", 1e3, hierarchy.Topology(1, 4)), "one node: no shaped link, nothing to judge away"


@pytest.mark.parametrize("algorithm", sorted(model.MODELS))
def test_the_model_check_fails_when_the_inside_link_is_used_for_the_inter_node_hop(algorithm):
    """Times measured on a slow link (here: made by the right model, 10% slower): the right model passes the
    25% check, the same model with the inside link on the across hop fails it at every size."""
    topology = hierarchy.Topology(2, 2)
    for nbytes in (125e3, 500e3, 1e6):
        measured = 1.1 * model.MODELS[algorithm](nbytes, topology, FAST, SLOW)
        assert model.judge(measured, model.MODELS[algorithm](nbytes, topology, FAST, SLOW))
        wrong = AlphaBeta(SLOW.alpha_s, FAST.beta_s_per_byte, 1.0)  # the node's bandwidth on the network hop
        assert not model.judge(measured, model.MODELS[algorithm](nbytes, topology, FAST, wrong))
        assert not model.judge(measured, model.lesson06_time_s(nbytes, topology, FAST, wrong))


def test_fit_link_takes_latency_from_the_ping_and_the_slope_from_the_stream():
    streamed = {size: 3e-4 + size / 12.5e6 for size in (125_000, 500_000, 1_000_000)}
    link = model.fit_link(streamed, 40e-6)
    assert link.alpha_s == 40e-6
    assert link.beta_s_per_byte == pytest.approx(1 / 12.5e6)


def test_bytes_per_step_of_each_parallelism():
    layers = model.Layers(hidden=64, blocks=4, tokens=512)
    schemes = model.step_messages(layers)
    assert schemes["tensor"]["messages"] == [512 * 64 * 4] * 8  # an all-reduce per block, forward and backward
    assert schemes["pipeline"]["messages"] == [512 * 64 * 4] * 2  # activations forward, their gradient back
    assert schemes["data"]["messages"] == [4 * (8 * 64 * 64 + 5 * 64) * 4]
    chosen = model.layers_for(1e6)
    tp = sum(model.step_messages(chosen)["tensor"]["messages"])
    assert 0.5e6 < tp <= 1e6 and chosen.tokens == 8 * chosen.hidden


def _schemes(ctx, layers):
    groups = hierarchy.make_groups(ctx.rank, hierarchy.Topology(2, 2))
    return traffic.time_schemes(ctx.rank, groups, layers, repeats=1)


def test_each_scheme_sends_its_bytes_on_each_level():
    layers = model.Layers(hidden=16, blocks=2, tokens=32)
    expected = {name: sum(scheme["messages"]) for name, scheme in model.step_messages(layers).items()}
    for rank, rows in enumerate(run_ranks(_schemes, 4, args=(layers,))):
        assert {(r["scheme"], r["level"]) for r in rows} == {(s, l) for s in expected for l in ("inside", "across")}
        for row in rows:
            assert row["bytes"] == expected[row["scheme"]]
            first = rank in ((0, 2) if row["level"] == "inside" else (0, 1))  # the first rank of its pair
            # all-reduce: each of 2 ranks sends the payload once in all; pipeline: activations out, gradients back
            assert row["sent"] == (row["bytes"] if row["operation"] == "all_reduce" else row["bytes"] // 2), row


def _local_sgd(ctx):
    return traffic.local_sgd_runs(ctx.rank, ctx.world_size, Problem(features=64, samples=256),
                                                steps=12, everies=(1, 4, 5), lr=0.05)


def test_local_sgd_every_step_is_synchronous_sgd_and_averages_less_often():
    rows = run_ranks(_local_sgd, 2)[0]
    by_every = {row["every"]: row for row in rows}
    assert by_every[1]["loss"] == pytest.approx(by_every[1]["sync_loss"], rel=1e-5)
    for row in rows:  # each k equals one process running every worker's k steps and averaging them
        assert row["loss"] == pytest.approx(row["reference_loss"], rel=1e-5)
    assert by_every[4]["loss"] != pytest.approx(by_every[1]["loss"], rel=1e-5), "k = 4 is not synchronous SGD"
    assert [by_every[k]["calls"] for k in (1, 4, 5)] == [12, 3, 3]
    assert all(row["loss"] < row["initial_loss"] for row in rows)


def test_options_are_checked():
    with pytest.raises(RequestError, match="unknown"):
        lab.Options.make(experiments=("link", "teleport"))
    with pytest.raises(RequestError, match="sgd_everies"):
        lab.Options.make(sgd_everies=(0,))
    assert lab.sweep_elements(12.5e6, 0.08) == [31232, 124928, 249856]


def _assert_mechanism(result, nodes, per_node):
    layouts = result.of_kind("layout")
    assert sorted(r["node"] for r in layouts) == [rank // per_node for rank in range(nodes * per_node)]
    for row in layouts:  # torchrun's GROUP_RANK says where each rank runs, without the rank arithmetic
        assert row["node"] == row["node_rank"], row
        assert row["inside_ranks"] == sorted(r["rank"] for r in layouts if r["node_rank"] == row["node_rank"]), row
    assert all(r["max_error"] == 0.0 for r in analysis.hierarchical_checks(result))
    assert {row["algorithm"] for row in analysis.all_reduce_rows(result)} == {"flat", "hierarchical"}
    return layouts


@pytest.mark.slow
def test_lab_on_one_host():
    from labsrc import launch
    result = launch.run("across_nodes", nproc=2, nnodes=2, timeout=120, echo=False,
                        experiments=("link", "all_reduce"), link_seconds=0.01, repeats=1)
    layouts = _assert_mechanism(result, 2, 2)
    assert all(r["link_bits"] is None and r["node_address"] == "" for r in layouts)
    assert analysis.throughput_ratio(result) is None
    assert analysis.link_bytes_rows(result) == []


@pytest.mark.slow
def test_lab_on_emulated_nodes():
    from labsrc import launch
    from labsrc.nodes import network
    available = network.availability()
    if not available.ok:
        pytest.skip(f"emulated nodes unavailable: {available.reason}")
    result = launch.run("across_nodes", nproc=2, nnodes=2, link="1gbit", timeout=120, echo=False,
                        experiments=("link", "all_reduce"), link_seconds=0.02, repeats=1)
    layouts = _assert_mechanism(result, 2, 2)
    assert sorted({(r["node"], r["node_address"]) for r in layouts}) == [(0, "198.18.0.1"), (1, "198.18.0.2")]
    assert all(r["link_bits"] == 10**9 for r in layouts)
    sent = {row["algorithm"]: row["ratio"] for row in analysis.link_bytes_rows(result)}
    assert set(sent) == {"flat", "hierarchical"}
    assert all(1 <= ratio <= 1 + model.LINK_OVERHEAD for ratio in sent.values()), sent


def test_fit_inside_is_lesson_02s_ring_link_of_the_nodes_all_reduce():
    link = AlphaBeta(30e-6, 1 / 1e9, 1.0)
    timings = {size: ring_allreduce_time_s(size, 2, link) for size in (1e5, 1e6, 1e7)}
    fitted = model.fit_inside(timings, 2)
    assert fitted.alpha_s == pytest.approx(link.alpha_s)
    assert fitted.beta_s_per_byte == pytest.approx(link.beta_s_per_byte)


def test_bench_nodes_says_why_it_cannot_run_and_refuses_a_bad_rate(monkeypatch, capsys):
    from labsrc import bench
    from labsrc.nodes import network
    monkeypatch.setenv("LABSRC_EMULATED_NODES", "off")
    assert bench.main(["nodes"]) == 2
    assert "LABSRC_EMULATED_NODES=off" in capsys.readouterr().out
    monkeypatch.delenv("LABSRC_EMULATED_NODES")
    if network.availability().ok:
        with pytest.raises(SystemExit):
            bench.main(["nodes", "--links", "fast"])
        assert "link" in capsys.readouterr().err


def test_bench_nodes_report_judges_each_target():
    """The report of a run whose throughput missed its target says so, and the rate's verdict is False."""
    from labsrc.lessons.across_nodes import bench as across_nodes_bench

    class Result:
        summary = {"nodes": 4, "ranks_per_node": 1, "link_bits": 10**8,
                   "fits": {"across": {"alpha_s": 0.0, "beta_s_per_byte": 8e-8, "r2": 1.0}}}

        def of_kind(self, kind, rank=None):
            if kind == "throughput":
                return [{"bytes_per_s": 9e6, "set_bytes_per_s": 12.5e6}]
            return [{"algorithm": "flat", "bytes": 10**6, "fastest_s": 0.12}] if kind == "all_reduce" else []

    lines, met = across_nodes_bench.report("100mbit", {(4, 1): Result()})
    assert not met and "MISSED" in lines[1] and "0.720" in lines[1]
    assert "ok" in lines[2], "measured 0.12 s against a model of 6 x 250 kB x 80 ns = 0.12 s"
