"""Model parallelism on a device mesh: tensor parallelism (AutoTP) and Ulysses sequence
parallelism, composed with ZeRO's data parallelism by the engine.
"""

__all__: list = []
