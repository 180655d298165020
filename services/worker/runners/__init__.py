"""Runners: the cached `ModelRunner`, the full-recompute `ReferenceRunner`, and decode's static form and graph cache."""
