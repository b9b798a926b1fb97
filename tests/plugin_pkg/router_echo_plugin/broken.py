"""An entry point whose import fails: the router must log it and go on."""

raise ImportError("this plugin needs a package that is not installed")
