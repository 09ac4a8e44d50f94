"""Helpers of the golden-value functional tests (Megatron's layout and schema).

Data flows one way:

    tensorboard event dir --tensorboard_reader--> metrics.json (golden schema, 5 decimals)
                                              +-> metrics_exact.json (same schema, unrounded)
    upstream + patched + golden --compare--> comparison.json, table, one-line verdict
                                 --plot----> loss_curves.png
    upstream == patched exactly --compare.update_golden--> golden_values_<env>_<platform>.json

Modules: ``golden_schema`` (typed file format), ``tensorboard_reader``, ``compare``, ``plot``.
"""
