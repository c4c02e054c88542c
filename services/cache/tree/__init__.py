"""The tiered radix tree, in rooms: node.py (the node, its counts, the receipts of a lock or a host pin),
orders.py (copy orders between the tiers), results.py (what the operations return, and `TreeUsage`),
radix_tree.py (the tree and its operations) and invariants.py (the oracle tests run)."""
