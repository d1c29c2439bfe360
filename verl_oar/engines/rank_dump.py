"""``$VERL_OAR_RANK_DUMP_DIR``: each rank saves what its importance pass scored (a debugging aid, off by default).

The trainer's step dump (``algorithm.oar.dump_dir``, ``integration.dump``) holds the whole batch after the
workers' outputs are gathered; it cannot say which rank scored which row. With this variable set (it reaches
the Ray workers with every ``VERL_OAR_*`` variable of a CPU run, ``cpu.launch.JOB_ENV_KEYS``), every rank of
the importance pass (``engines.driver``) writes ``{dir}/step_{step}_{method}_rank{rank}.pt``:

- ``rank``, ``world_size`` (torch.distributed; 0 and 1 without it), ``dp_rank``, ``dp_size`` (the engine's
  data-parallel group), ``step``, ``method`` (``gradient`` or ``perturbation``), ``fused`` (OAR-G inside
  verl's old-log-prob pass), ``pid``;
- the rank's rows in the order it received them: ``prompts`` and ``responses`` (token ids, a list per row:
  the row's identity, as the trainer's dump and verl's rollout files have it), ``oar_importance``,
  ``oar_reasoning_mask``, ``oar_answer_mask`` (a 1-D tensor per row, over the response);
- ``param_numel_local`` and ``param_numel_full``: the elements of the model's parameters this rank holds
  (an FSDP2 shard is a ``DTensor``'s local tensor) and of the whole model;
- where the rank ran and what it ran: ``node_id`` (the Ray node of this worker, ``ray.get_runtime_context()``;
  None outside Ray), ``hostname``, ``plugin_imported_through`` (``integration.plugin.IMPORTED_THROUGH``: verl's
  ``verl.plugins`` entry point, or the importing file; None when no plugin was loaded) and ``verl_oar_file`` (the
  package this worker imported).

Checked against verl 0.9.1 (``engine.get_data_parallel_rank``/``_size``, ``engine.module``).
"""

from __future__ import annotations

import os
import socket
import sys

import torch

RANK_DUMP_ENV = "VERL_OAR_RANK_DUMP_DIR"


def rank_dump_dir() -> str | None:
    """Where ranks dump their rows (``$VERL_OAR_RANK_DUMP_DIR``), or None: no dump."""
    return os.environ.get(RANK_DUMP_ENV) or None


def parameter_numel(module: torch.nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model) over ``module``'s parameters."""
    from torch.distributed.tensor import DTensor

    local = full = 0
    for param in module.parameters():
        full += param.numel()
        local += param.to_local().numel() if isinstance(param, DTensor) else param.numel()
    return local, full


def ray_node_id() -> str | None:
    """The Ray node this process runs on (hex), or None outside a Ray worker."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - a debugging aid: never fail the pass over it
        return None


def dump_rank_rows(directory: str, engine, data, *, step: int, method: str, fused: bool,
                   importance: list[torch.Tensor], reasoning: list[torch.Tensor], answer: list[torch.Tensor]) -> str:
    """Write this rank's file (module docstring) and return its path. ``data`` is the rank's batch (nested
    ``prompts``/``responses``); the three lists hold one (response_len,) tensor per row, in ``data``'s order."""
    import torch.distributed as dist

    import verl_oar

    # what loaded the plugin in this process, looked up, not imported (engines do not import integration): None
    # if nothing did
    plugin = sys.modules.get("verl_oar.integration.plugin")
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    local, full = parameter_numel(engine.module)
    payload = {
        "rank": rank, "world_size": world, "step": step, "method": method, "fused": fused, "pid": os.getpid(),
        "dp_rank": int(engine.get_data_parallel_rank()), "dp_size": int(engine.get_data_parallel_size()),
        "prompts": [row.tolist() for row in data["prompts"].unbind()],
        "responses": [row.tolist() for row in data["responses"].unbind()],
        "oar_importance": [row.detach().cpu() for row in importance],
        "oar_reasoning_mask": [row.detach().cpu() for row in reasoning],
        "oar_answer_mask": [row.detach().cpu() for row in answer],
        "param_numel_local": local, "param_numel_full": full,
        "node_id": ray_node_id(), "hostname": socket.gethostname(),
        "plugin_imported_through": getattr(plugin, "IMPORTED_THROUGH", None), "verl_oar_file": verl_oar.__file__,
    }
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"step_{step}_{method}_rank{rank}.pt")
    torch.save(payload, path)
    return path
