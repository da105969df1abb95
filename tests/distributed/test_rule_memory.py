"""Memory per rank of a matrix rule whose state is not shaped like the parameter (SOAP: fp32 moments,
fp64 factors and eigenbases, 4·2mn + 8·(2m² + 2n²) bytes a matrix), counted tensor bytes: on owners each
matrix's state exists once across the ranks; under --mfsdp-layout even (the reconstruction
baseline) every rank that holds a slice of a matrix keeps its whole state."""

import pytest

from megatron_mfsdp.testing import init_megatron, optimizer_config, run_workers, tiny_gpt


def _worker(rank, world_size, layout):
    from megatron_mfsdp import MatrixFSDP, MatrixFSDPConfig, get_megatron_optimizer
    from megatron_mfsdp.optim import registry

    init_megatron()
    cfg = optimizer_config(optimizer="soap")
    config, model = tiny_gpt(by_global_name=True)
    ddp = MatrixFSDP(config, MatrixFSDPConfig(layout=layout, rules=registry.rule_set((), cfg, layout)), model)
    opt = get_megatron_optimizer(cfg, [ddp])
    soap = [o for o in opt.owned_pieces() if o.rule.startswith("soap")]
    return {
        "soap_state": sum(t.numel() * t.element_size() for o in soap for t in o.state.values()),
        "soap_matrices": sorted(o.global_name for o in soap),
        "shapes": {o.global_name: o.param_shape for o in soap},
        "optimizer_state": opt.local_bytes()["optimizer_state"],
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_soap_state_lives_once_on_owners_and_on_every_holder_under_even(world_size):
    owner = run_workers(world_size, _worker, "owner")
    even = run_workers(world_size, _worker, "even")
    shapes = {n: s for r in owner + even for n, s in r["shapes"].items()}
    per_matrix = {n: 4 * 2 * m * k + 8 * (2 * m * m + 2 * k * k) for n, (m, k) in shapes.items()}
    # Owners: every matrix's state on exactly one rank, 4·2mn + 8·(2m² + 2n²) bytes of it.
    held = [n for r in owner for n in r["soap_matrices"]]
    assert sorted(held) == sorted(per_matrix)
    assert sum(r["soap_state"] for r in owner) == sum(per_matrix.values())
    # Even: every rank holding a slice keeps the whole state of that matrix.
    for r in even:
        assert r["soap_state"] == sum(per_matrix[n] for n in r["soap_matrices"])
    busiest_owner = max(r["optimizer_state"] for r in owner)
    busiest_even = max(r["optimizer_state"] for r in even)
    print(
        f"\nDP{world_size} SOAP optimizer state per rank (bytes): owner {[r['optimizer_state'] for r in owner]}, "
        f"even {[r['optimizer_state'] for r in even]}; "
        f"busiest even / busiest owner = {busiest_even / busiest_owner:.2f}"
    )
    assert busiest_even > busiest_owner
