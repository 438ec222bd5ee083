"""The studies: experiments run with the library, each a plan of training runs and the report
that answers its question (does MoD beat dense at equal training FLOPs, and what about MoE,
the KV strategies, converting a pretrained model, a second round on BPE tokens, a GPU).

A study trains models to fixed training-FLOP budgets, appends each finished run to its
``results.jsonl`` (resumable: rerun to go on) and rewrites its report from the results. The
default folders of each are on its plan (`runner.Plan.folders`, or the module's ``FOLDERS``).

- `runner`: what they share: `RunSpec`, `run_one`, `steps_for_budget`, `Plan` and `study`;
- `isoflop`, `mode`, `kv`: plans for `runner.study` (`mod study`, ``--plan mode``, ``--plan kv``);
- `convert`, `round2`: studies with their own loops (``--plan convert``, ``--plan round2``);
- `measure`, `plots`: decode measurements and figures shared by several plans;
- `workers`: ``mod study experiments/round2 --workers N``; `gpu`: ``python -m
  mixture_of_depths.studies.gpu``, round 3's deciding arms on one GPU inside a lease.

The rule is one way: studies depend on the library, `mixture_of_depths.train`, `runtime` and
`bench`; nothing in the library imports a study, and of the command line only ``cli/study.py``
does.
"""
