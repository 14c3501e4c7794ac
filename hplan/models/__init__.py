"""Built-in workloads: the bundled GPT (`gpt:<size>`) and Hugging Face models (`hf:<Class>`)."""
