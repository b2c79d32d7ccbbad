"""Builds the one C piece, the region-of-interest JPEG decoder (terrapipe/pipeline/_jpeg.c) on
libjpeg-turbo; everything else is in pyproject.toml. The extension is optional: without a C
compiler or libjpeg's headers, terrapipe installs and decodes every image with Pillow."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "terrapipe.pipeline._jpeg",
            ["terrapipe/pipeline/_jpeg.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
