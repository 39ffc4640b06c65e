"""bench.metrics_scrape: sample lines of the text format counted per metric family."""
from __future__ import annotations

from bench.metrics_scrape import family_of


def test_a_sample_line_belongs_to_its_family_whatever_its_suffix_and_labels():
    assert family_of('ddtree_step_segment_seconds_bucket{le="0.001",segment="push_trip"} 3.0') == \
        "ddtree_step_segment_seconds"
    assert family_of("vllm:generation_tokens_total 12.0") == "vllm:generation_tokens"
    assert family_of("vllm:num_requests_running 0.0") == "vllm:num_requests_running"
    assert family_of('ddtree_steps_created{model_name="m"} 1.7e9') == "ddtree_steps"
