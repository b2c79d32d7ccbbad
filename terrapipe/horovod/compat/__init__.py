"""The folder ``terrapipe run --horovod`` puts first on PYTHONPATH: it holds a ``horovod``
package whose ``horovod.torch`` is terrapipe.horovod. Nothing imports it otherwise, so an
installed Horovod is never shadowed."""
