"""terrapipe.testing: tools for testing and measuring distributed training on one machine.

``terrapipe.testing.cluster`` emulates several machines joined by shaped network links (network
namespaces, veth pairs and a bridge) and runs one MPI job across them.
"""
