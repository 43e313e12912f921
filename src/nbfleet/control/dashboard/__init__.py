"""The web dashboard at ``/``: server-rendered pages, assets in the package."""
