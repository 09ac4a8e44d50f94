"""Helpers of the golden-value functional tests (Megatron's layout and schema).

Data flows one way:

    tensorboard event dir --tensorboard_reader--> metrics.json (golden schema, 5 decimals)
                                              +-> metrics_exact.json (same schema, unrounded)
    upstream + patched + golden --checks (tolerances)--> findings --verdicts--> comparison.json
                                 --formatting--> table, one-line verdict
                                 --plot--------> loss_curves.png
    upstream == patched exactly --golden_update--> golden_values_<env>_<platform>.json

Modules: ``golden_schema`` (typed file format), ``tensorboard_reader``, ``tolerances``
(per-metric rules), ``checks`` (exact and golden), ``verdicts``, ``formatting``,
``golden_update``, ``plot``; ``run_case`` runs a case end to end.
"""
