"""Ray on this machine: a local head (``head``) and the local cluster tgctl starts (``cluster``)."""
