"""shardtrain: a distributed training engine for PyTorch."""
__version__ = "0.1.0"
