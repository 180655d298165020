"""Model code: DeepSeek-V4.1 in PyTorch (``model.deepseek_v41``)."""
