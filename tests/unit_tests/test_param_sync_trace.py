"""harness/param_sync_trace.py: reading the ranks' summaries back from a shared stdout."""

from __future__ import annotations

import json

from harness import param_sync_trace as pst


def test_parse_log_keeps_a_summary_that_another_rank_wrote_into():
    """Ranks share stdout: a summary line may carry another rank's output after its JSON
    (seen in a 4-rank run: a line of dashes). Both summaries come back, sorted by rank."""
    one = {"rank": 1, "bucket_groups": [{"chunk": 0, "numel": 33088}]}
    zero = {"rank": 0, "bucket_groups": []}
    log = "\n".join([
        "iteration 1/ 20 | lm loss: 8.3",
        pst.MARKER + json.dumps(one, sort_keys=True) + "-" * 40,
        "[rank0]: some warning",
        pst.MARKER + json.dumps(zero, sort_keys=True),
    ])
    assert pst.parse_log(log) == [zero, one]
    assert pst.parse_log("no summaries here\n") == []
