"""The in-repo examples and model zoo, importable under one name from a checkout of the
repository (the repository root on ``sys.path``): ``examples.models``, ``examples.data``.

The repository root is also the package ``tidal``; importing this folder as ``tidal.examples``
would load every zoo module a second time under another name (two ``LlamaForCausalLM`` classes
that ``isinstance`` tells apart), so it is refused. (A model file given to the CLI by path is
imported under its package's name from where it lies; that is the user's choice.)"""
if __name__ == "tidal.examples":
    raise ImportError(f"import the in-repo examples as 'examples' (examples.models), not as "
                      f"{__name__!r}")
