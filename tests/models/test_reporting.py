"""models.report: a plan with a stage axis reports the pipelined step, not the flat one."""

import shardkit as sk
from shardkit import models


def test_a_pipeline_plan_reports_its_pipelined_step_against_the_pipeline_model():
    plan = sk.Plan("dp_pp", sk.make_mesh({"stage": 2, "data": 4}))
    r = models.report(plan, models.get("gpt-tiny"), batch=8, seq=32)
    # The flat step has no pipeline options, so it would have no analytic model at all;
    # the pipelined one holds half the layer stack per device and sends activations
    # between the two stages (collective-permutes), as the pipeline model says.
    assert r.analytic is not None
    assert abs(r.ratios()["state_memory"] - 1) < 0.02
    assert abs(r.ratios()["wire_bytes"] - 1) < 0.02
    assert r.wire_bytes_by_kind.get("collective-permute", 0) > 0
