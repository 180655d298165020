"""A chat's images on the engine side: encoding them (the multimodal service or in process) and the prompt the model
reads."""
