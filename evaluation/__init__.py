"""Downstream evaluation with lm-evaluation-harness: the harness's language model over a run's
own forward (harness.py) and the tasks, found, run and hooked into training (tasks.py). Below
`trainer`, which hands it the run's scoring forward (trainer/scoring.py); `lm_eval` is imported
only here and in eval.py (the optional `eval` extra)."""
