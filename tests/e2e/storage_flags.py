"""Server flags shared by the storage-tier modules: the file tier (opt-in), small device pools, and
prefetches that wait for storage to complete (for at most 20 s; the last two items)."""

STORAGE_FLAGS = (
    "--hicache-storage-backend", "file",
    "--max-total-tokens", "4096", "--max-mamba-cache-size", "32", "--max-context-len", "512",
    "--prefetch-threshold", "32", "--hicache-storage-prefetch-policy", "wait_complete",
    "--prefetch-timeout-max-s", "20",
)
