"""``horovod.runner`` as far as scripts and Horovod's own test helpers import it under
``terrapipe run --horovod``; launching is ``terrapipe run``'s job."""
