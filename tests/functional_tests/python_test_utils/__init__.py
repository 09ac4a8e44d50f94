"""Helpers of the golden-value functional tests (Megatron's layout and schema).

Data flows one way:

    tensorboard event dir --tensorboard_reader--> metrics.json (golden schema, 5 decimals)
                                              +-> metrics_exact.json (same schema, unrounded)
    pristine + series + golden --checks (tolerances)--> findings --verdicts--> comparison.json
                                 --formatting--> table, one-line verdict
                                 --plot--------> loss_curves.png
    pristine == series exactly --golden_update--> golden_values_<env>_<platform>.json
    ranks' param_sync/rank<R>.json --memory_report--> memory.json --> comparison.json,
                                 the memory block of the verdict, the plot's memory panel

Modules: ``golden_schema`` (typed file format), ``tensorboard_reader``, ``tolerances``
(per-metric rules), ``checks`` (exact and golden), ``verdicts``, ``formatting``,
``golden_update``, ``memory_report``, ``plot``; ``run_case`` runs a case end to end.
"""
