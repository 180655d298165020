"""The multimodal service: image bytes → placeholder-span embeddings from the vision tower."""
