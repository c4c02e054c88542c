"""PyTorch reference implementations: exact, vectorised, device-agnostic (CPU and CUDA)."""
