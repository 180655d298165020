"""The tokenizer: encode, chat rendering through deepseek-recipe, incremental detokenization."""
