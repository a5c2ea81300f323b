#!/usr/bin/env bash
exec "$(dirname "$0")/matched_commands.sh" tldr
