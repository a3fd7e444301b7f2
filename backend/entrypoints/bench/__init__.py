"""`npu-llm bench`: throughput against transformers, serving overhead, MoE experts, disaggregation."""
