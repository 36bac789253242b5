"""What a run trains: one module per objective behind one registry (registry.py), looked up by
`train.objective`.

- lm.py: next-token prediction (and the loss every token objective shares, with the model's terms).
- sft.py: supervised fine-tuning, the LM loss on the tokens a corpus marks.
- dpo.py: direct preference optimization against a frozen reference.
- distill.py: knowledge distillation from a frozen teacher's logits.
- grpo.py: reinforcement learning (GRPO) on completions the model samples itself, scored by rewards.

    objective = objectives.build(cfg)  # its config checks passed
    objective.loss_fn(graphdef, compute), objective.eval_fn(...), objective.batch_fn(...)
    objective.step_metrics(aux), objective.eval_metrics(sums), objective.console(record)
    objective.data_format, objective.rows_per_example, objective.frozen (the weights the state holds frozen)
"""

from trainer.objectives import distill, dpo, grpo, lm, sft  # noqa: F401 (each registers its objective)
from trainer.objectives.registry import Frozen, Objective, build, get, names, register

__all__ = ["Frozen", "Objective", "build", "get", "names", "register"]
