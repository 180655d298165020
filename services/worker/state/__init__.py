"""What a worker holds for its requests: the paged cache pools, Engram rows and image embeddings."""
