"""The handmade DDPs match torch DDP and single-process training on 2 and 4 gloo ranks; DDP's settings behave."""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from labsrc import ddp_tools, handmade_ddp
from labsrc.testing import run_ranks


def _train(ctx, version, steps=3, width=32):
    make = lambda: ddp_tools.layered_model(layers=3, width=width)
    model = {"torch": lambda: DDP(make()), "after_backward": lambda: handmade_ddp.AllReduceAfterBackward(make()),
             "buckets": lambda: handmade_ddp.BucketedDDP(make(), bucket_cap_mb=0.005)}[version]()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gradients = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * step + ctx.rank)
        images, labels = torch.randn(4, width, generator=generator), torch.randint(10, (4,), generator=generator)
        ddp_tools.one_step(model, images, labels)
        if version == "after_backward":
            model.sync_gradients()
        elif version == "buckets":
            model.finish_gradient_sync()
        gradients.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    return gradients, [p.detach().clone() for p in model.parameters()]


def _single(world_size, steps=3, width=32):
    model = ddp_tools.layered_model(layers=3, width=width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        batches = []
        for rank in range(world_size):
            generator = torch.Generator().manual_seed(100 * step + rank)
            batches.append((torch.randn(4, width, generator=generator), torch.randint(10, (4,), generator=generator)))
        ddp_tools.one_step(model, torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("version", ["after_backward", "buckets"])
def test_handmade_ddp_matches_torch_ddp_and_one_process(world_size, version):
    theirs = run_ranks(_train, world_size, args=("torch",))
    mine = run_ranks(_train, world_size, args=(version,))
    single = _single(world_size)
    for (torch_grads, torch_params), (my_grads, my_params) in zip(theirs, mine):
        for step_theirs, step_mine in zip(torch_grads, my_grads):
            for a, b in zip(step_theirs, step_mine):
                torch.testing.assert_close(b, a)
        for a, b, c in zip(torch_params, my_params, single):
            torch.testing.assert_close(b, a)
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)


def test_bucket_rule_closes_at_the_cap_in_reverse_order():
    parameters = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 10, 30, 5)]  # 40, 40, 120, 20 bytes
    assert handmade_ddp.assign_buckets(parameters, 50) == [[3, 2], [1, 0]]
    assert handmade_ddp.assign_buckets(parameters, 10**6) == [[3, 2, 1, 0]]


def _bucketed_counts(ctx):
    model = handmade_ddp.BucketedDDP(ddp_tools.layered_model(layers=3, width=32), bucket_cap_mb=0.005)
    ddp_tools.one_step(model, torch.randn(4, 32), torch.randint(10, (4,)))
    launches = [name for name, _ in model.events if name.startswith("all_reduce")]
    model.finish_gradient_sync()
    return len(model.buckets), model.allreduce_calls, launches, [name for name, _ in model.events]


def test_bucketed_version_launches_all_reduces_before_backward_ends():
    buckets, calls, launches, events = run_ranks(_bucketed_counts, 2)[0]
    assert calls == buckets == len(launches) > 1
    assert events.index("all_reduce 0") < events.index("hook 0"), "the first bucket must go before the last gradient"


def _settings(ctx):
    images, labels = torch.randn(8, 16), torch.randint(10, (8,))
    make = lambda: ddp_tools.layered_model(layers=2, width=16)
    return (ddp_tools.unused_parameter_outcomes(images, labels),
            ddp_tools.bucket_view_comparison(make, images, labels, bucket_cap_mb=25),
            ddp_tools.compression_comparison(make, images, labels))


def test_unused_parameters_bucket_view_and_compression():
    unused, views, compression = run_ranks(_settings, 2)[0]
    assert unused["default"].startswith("RuntimeError: Expected to have finished reduction")
    assert unused["find_unused_parameters=True"] == "ok" and unused["static_graph=True"] == "ok"
    assert views["view=True"]["distinct_storages"] < views["view=False"]["distinct_storages"]
    assert views["bytes_saved"] == views["view=False"]["gradient_bytes"] > 0
    for name in ("fp16 compression", "bf16 compression"):
        if compression[name]["ok"]:
            assert compression[name]["bytes"] * 2 == compression["fp32 all-reduce"]["bytes"]
            assert 0 < compression[name]["max_error"] < 1e-2
