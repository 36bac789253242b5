"""Where a run's state comes from, decided in one place: `initial_state` restores the newest
readable checkpoint of either tier (`checkpointer`: the persistent tier with the local one
attached), or imports init.from_hf, or draws a random init.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from model import hf
from model.lora import join
from ops.metrics import log
from trainer.checkpoint import Checkpointer, RunDir, checkpoint_dir
from trainer.program import Program
from trainer.state import TrainState, frozen_base, init_state, random_params, state_from_params
from trainer.tiers import LocalTier


@dataclasses.dataclass(frozen=True)
class Start:
    """The state a run starts from (`initial_state`), its step, and where it came from: "random"
    (run.seed), "hf" (init.from_hf), or the checkpoint tier resumed, "local" or "persistent"."""

    state: TrainState
    step: int
    origin: str

    @property
    def resumed(self) -> bool:
        return self.origin in ("local", "persistent")


def initial_state(program: Program, ckpt: Checkpointer, iterator: Any, found: RunDir) -> Start:
    """The state the run starts from, and where from; the one place that decides it:
    - the newest readable checkpoint of either tier (Checkpointer.restore_latest: the local tier's
      when newer), `iterator` rewound to its data position; a LoRA run's checkpoints hold the
      adapters alone, and its frozen base is read again (trainer.state.frozen_base);
    - else, when run.dir held no checkpoints (`found`), the Hugging Face weights of init.from_hf;
    - else a random init from run.seed (also when every checkpoint proved unreadable and
      checkpoint.fresh_if_unreadable let the run start over).
    A new state (not restored) gets the objective's loaded frozen weights (a teacher: Program.with_frozen)."""
    cfg, sh = program.spec.cfg, program.state_sh
    restored = ckpt.restore_latest(program.abstract_state(), iterator, warn=log)
    if restored is not None:
        step, state = restored
        if ckpt.local is not None and ckpt.restored_tier == "persistent":
            log(f"restoring from the persistent tier: step {step}")
        if cfg.model.lora.enabled:
            base = frozen_base(cfg.model, cfg.init.from_hf, cfg.run.seed, sh.params)
            state = state.replace(params=join(state.params, base))
        log(f"resumed from step {step}")
        return Start(state, step, ckpt.restored_tier)
    if cfg.init.from_hf and not found.checkpoints:
        if found.local:  # `prepare` left it unchecked: the local tier's steps were to resume the run
            hf.check_compatible(cfg.model, cfg.init.from_hf)
        params = hf.load_params(cfg.init.from_hf, cfg.model, sh.params)
        if cfg.model.mtp_depth:  # no Hugging Face checkpoint holds them: they start from the random init
            params["mtp"] = random_params(cfg.model, cfg.run.seed, sh.params, "mtp")
        state = state_from_params(params, program.tx, program.init_sh, cfg.model, cfg.run.seed)
        log(f"initialized the parameters from {cfg.init.from_hf} (init.from_hf)")
        return Start(program.with_frozen(state), 0, "hf")
    # A new state: the objective's frozen weights loaded (a teacher), if any.
    return Start(program.with_frozen(init_state(cfg.model, program.tx, cfg.run.seed, program.init_sh)), 0, "random")


def checkpointer(program: Program) -> Checkpointer:
    """The run's checkpointer, with the local tier attached when checkpoint.local_dir is set."""
    cfg = program.spec.cfg
    ckpt = Checkpointer(checkpoint_dir(cfg.run.dir), cfg.checkpoint)
    if cfg.checkpoint.local_dir:
        ckpt.attach_local(LocalTier(cfg, program.mesh, program.abstract_state()))
        if jax.process_count() > 1 and not ckpt.local.peers:
            log("warning: no other process holds a copy of this process's shards (mesh.data does not span "
                "processes): a lost host's local checkpoints are lost, the persistent tier remains")
    return ckpt
