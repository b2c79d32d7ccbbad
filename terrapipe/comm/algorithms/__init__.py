"""The algorithms collectives run by, each a module of functions over a transport
(comm/transports/); comm/select.py picks one per call (NOTE [algorithm selection] there).

===========  ==============================================  ==========================
algorithm    what it does                                    over
===========  ==============================================  ==========================
oneshot      signature and data published together, every    shm
             rank reduces the whole small message
oneshot_     the same on each node, then the node's          shm + mpi (exchange of
nodes        partial and signatures to the other nodes       tables)
segment      chunked copy in / reduce by parts / copy out    shm (+ mpi across nodes:
             through the node's rows; hierarchical across    hierarchical)
             nodes
shared       in place on shared arrays, one pass             shm (+ mpi across nodes)
staged_rows  a device-staged message copied by the GPU       shm (rows registered with
             straight into and out of the rows, reduced      CUDA)
             there in one pass
single_copy  reads of the peers' private memory              shm board + cma
ring         chunked ring over point-to-point                mpi
native       the library's own collectives                   mpi, gloo
adasum       Adasum by vector halving over pairs' groups,    any (through select)
             or one gathering allreduce for small messages
===========  ==============================================  ==========================

NCCL's own collectives of CUDA tensors are comm/transports/nccl.py's.
"""
