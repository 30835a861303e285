"""Proxmox hosts and their containers: discover, prepare, doctor."""
