"""The npu-llm commands (`npu-llm serve`, `up`, `chat`, `bench`, ...): above the library, which never imports them."""
