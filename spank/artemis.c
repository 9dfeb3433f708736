/*
 * artemis.so — SPANK plugin behind `sbatch|salloc|srun --artemis=on|off`.
 *
 * plugstack.conf:
 *   optional /usr/lib/x86_64-linux-gnu/slurm-wlm/artemis.so \
 *       endpoint=http://artemisd:7600 default=off window_steps=50 \
 *       autoload=/usr/lib/python3/dist-packages/torch_hook/autoload
 *
 * What it does, by context (spank(8)):
 *   allocator (sbatch, salloc) and local (srun that allocates):
 *       records the choice for the job with spank_job_control_setenv("ARTEMIS"),
 *       so Prolog/Epilog see SPANK_ARTEMIS=on|off.
 *   remote (slurmstepd), for opted-in jobs only:
 *       exports ARTEMIS_ENABLED=1, ARTEMIS_ENDPOINT, ARTEMIS_JOB_ID,
 *       ARTEMIS_WINDOW_STEPS to the tasks and prepends the probe's autoload
 *       folder (its sitecustomize.py) to PYTHONPATH, so an unchanged
 *       `srun python train.py` is instrumented.
 *
 * It never fails a job: a bad plugstack argument or a missing endpoint is
 * logged and the job runs uninstrumented.  Only a bad --artemis value typed
 * by the user is rejected, at submission, like any other bad option.
 *
 * Slurm 22.05 quirk (design.md §5): sbatch and salloc ignore a static
 * `spank_options` table, so the option is registered with
 * spank_option_register() from slurm_spank_init().
 *
 * The .so is tied to the Slurm major release it was compiled against: Slurm
 * compares plugin_version (SPANK_PLUGIN below) with its own at load time.
 */

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <slurm/slurm_version.h>
#include <slurm/spank.h>

SPANK_PLUGIN(artemis, 1);

#define ARTEMIS_MAX_WINDOW_STEPS 100000
#define ARTEMIS_PATH_MAX 4096

/* Recorded for `strings artemis.so` and the plugin's log line (the Makefile passes it). */
#ifndef ARTEMIS_SLURM_VERSION
#error "build with make -C spank: it passes ARTEMIS_SLURM_VERSION from slurm_version.h"
#endif
const char artemis_built_for_slurm[] = "artemis spank built for Slurm " ARTEMIS_SLURM_VERSION;

enum choice { CHOICE_UNSET = -1, CHOICE_OFF = 0, CHOICE_ON = 1 };

static enum choice user_choice = CHOICE_UNSET;
static enum choice site_default = CHOICE_OFF;
static char endpoint[ARTEMIS_PATH_MAX];
static char autoload[ARTEMIS_PATH_MAX];
static long window_steps; /* 0 = let the probe use its default */

static int parse_choice(const char *text, enum choice *out)
{
	if (!text)
		return -1;
	if (!strcmp(text, "on") || !strcmp(text, "yes") || !strcmp(text, "1")) {
		*out = CHOICE_ON;
		return 0;
	}
	if (!strcmp(text, "off") || !strcmp(text, "no") || !strcmp(text, "0")) {
		*out = CHOICE_OFF;
		return 0;
	}
	return -1;
}

static int option_cb(int val, const char *optarg, int remote)
{
	(void) val;
	(void) remote;
	if (parse_choice(optarg, &user_choice) < 0) {
		slurm_error("artemis: --artemis=%s: expected on or off", optarg);
		return -1;
	}
	return 0;
}

static struct spank_option artemis_option = {
	"artemis", "on|off",
	"Let Artemis watch this job for stragglers (slow GPU, link, host or "
	"input) and act within the site's policy.",
	/*
	 * The value is required: sbatch forwards a bare optional flag to the
	 * job's sruns as the literal string "(null)" (22.05), which then fails.
	 */
	1, 0, option_cb,
};

static int copy_arg(char *dst, const char *value, const char *key)
{
	if (strlen(value) >= ARTEMIS_PATH_MAX) {
		slurm_error("artemis: plugstack %s= is longer than %d characters; ignored",
			    key, ARTEMIS_PATH_MAX - 1);
		return -1;
	}
	strcpy(dst, value);
	return 0;
}

/* Bad arguments are logged and dropped: a typo in plugstack.conf must not stop jobs. */
static void parse_plugstack_args(int ac, char **av)
{
	for (int i = 0; i < ac; i++) {
		const char *arg = av[i];
		if (!strncmp(arg, "endpoint=", 9)) {
			const char *value = arg + 9;
			if (strncmp(value, "http://", 7) && strncmp(value, "https://", 8) &&
			    strncmp(value, "file:", 5)) {
				slurm_error("artemis: plugstack endpoint=%s: expected http://HOST:PORT, "
					    "https://… or file:/PATH; jobs run uninstrumented", value);
				continue;
			}
			copy_arg(endpoint, value, "endpoint");
		} else if (!strncmp(arg, "default=", 8)) {
			if (parse_choice(arg + 8, &site_default) < 0) {
				slurm_error("artemis: plugstack default=%s: expected on or off; using off",
					    arg + 8);
				site_default = CHOICE_OFF;
			}
		} else if (!strncmp(arg, "window_steps=", 13)) {
			char *end = NULL;
			errno = 0;
			long steps = strtol(arg + 13, &end, 10);
			if (errno || !end || *end || end == arg + 13 || steps < 1 ||
			    steps > ARTEMIS_MAX_WINDOW_STEPS) {
				slurm_error("artemis: plugstack window_steps=%s: expected 1..%d; "
					    "using the probe's default", arg + 13, ARTEMIS_MAX_WINDOW_STEPS);
				continue;
			}
			window_steps = steps;
		} else if (!strncmp(arg, "autoload=", 9)) {
			if (arg[9] != '/') {
				slurm_error("artemis: plugstack autoload=%s: expected an absolute path; "
					    "jobs run uninstrumented", arg + 9);
				continue;
			}
			copy_arg(autoload, arg + 9, "autoload");
		} else {
			slurm_error("artemis: unknown plugstack argument '%s' ignored "
				    "(known: endpoint= default= window_steps= autoload=)", arg);
		}
	}
}

static int opted_in(void)
{
	return user_choice == CHOICE_UNSET ? site_default == CHOICE_ON : user_choice == CHOICE_ON;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();

	parse_plugstack_args(ac, av);
	if (ctx == S_CTX_ALLOCATOR || ctx == S_CTX_LOCAL || ctx == S_CTX_REMOTE) {
		if (spank_option_register(sp, &artemis_option) != ESPANK_SUCCESS)
			slurm_error("artemis: cannot register --artemis; jobs run uninstrumented");
	}
	return ESPANK_SUCCESS;
}

/* Record the choice where Prolog/Epilog will see it (as SPANK_ARTEMIS). */
static void record_choice(spank_t sp)
{
	spank_err_t rc = spank_job_control_setenv(sp, "ARTEMIS", opted_in() ? "on" : "off", 1);
	/* srun inside an existing allocation has no job control env: nothing to record. */
	if (rc != ESPANK_SUCCESS)
		slurm_debug("artemis: job control env not set: %s", spank_strerror(rc));
}

static void setenv_logged(spank_t sp, const char *name, const char *value)
{
	spank_err_t rc = spank_setenv(sp, name, value, 1);
	if (rc != ESPANK_SUCCESS)
		slurm_error("artemis: cannot set %s: %s", name, spank_strerror(rc));
}

static int export_to_tasks(spank_t sp)
{
	uint32_t job_id = 0;
	char number[32];
	char pythonpath[2 * ARTEMIS_PATH_MAX];
	char current[ARTEMIS_PATH_MAX];
	spank_err_t rc;

	if (!endpoint[0] || !autoload[0]) {
		slurm_error("artemis: job opted in but plugstack.conf lacks %s; running it "
			    "uninstrumented", !endpoint[0] ? "a valid endpoint=" : "a valid autoload=");
		return ESPANK_SUCCESS;
	}
	if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS) {
		slurm_error("artemis: no job id in this step; running it uninstrumented");
		return ESPANK_SUCCESS;
	}

	rc = spank_getenv(sp, "PYTHONPATH", current, sizeof(current));
	if (rc == ESPANK_SUCCESS && current[0])
		snprintf(pythonpath, sizeof(pythonpath), "%s:%s", autoload, current);
	else if (rc == ESPANK_SUCCESS || rc == ESPANK_ENV_NOEXIST)
		snprintf(pythonpath, sizeof(pythonpath), "%s", autoload);
	else {
		slurm_error("artemis: cannot read PYTHONPATH (%s); running uninstrumented",
			    spank_strerror(rc));
		return ESPANK_SUCCESS;
	}
	/* The step may be a second srun of the same job: do not prepend twice. */
	if (rc == ESPANK_SUCCESS && !strncmp(current, autoload, strlen(autoload)) &&
	    (current[strlen(autoload)] == ':' || current[strlen(autoload)] == '\0'))
		snprintf(pythonpath, sizeof(pythonpath), "%s", current);

	setenv_logged(sp, "PYTHONPATH", pythonpath);
	setenv_logged(sp, "ARTEMIS_ENDPOINT", endpoint);
	snprintf(number, sizeof(number), "%" PRIu32, job_id);
	setenv_logged(sp, "ARTEMIS_JOB_ID", number);
	if (window_steps > 0) {
		snprintf(number, sizeof(number), "%ld", window_steps);
		setenv_logged(sp, "ARTEMIS_WINDOW_STEPS", number);
	}
	setenv_logged(sp, "ARTEMIS_ENABLED", "1");
	slurm_verbose("artemis: job %" PRIu32 " instrumented, reporting to %s (%s)",
		      job_id, endpoint, artemis_built_for_slurm);
	return ESPANK_SUCCESS;
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	(void) ac;
	(void) av;
	spank_context_t ctx = spank_context();

	if (ctx == S_CTX_ALLOCATOR || ctx == S_CTX_LOCAL)
		record_choice(sp);
	return ESPANK_SUCCESS;
}

/* Remote context, once per step, before the tasks are forked. */
int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
	(void) ac;
	(void) av;
	if (!opted_in())
		return ESPANK_SUCCESS;
	return export_to_tasks(sp);
}
