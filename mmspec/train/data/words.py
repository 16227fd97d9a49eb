"""Word lists for the ``text`` family.

:func:`word_list` is :data:`BUILTIN_WORDS`, on every machine. It used to read
``/usr/share/dict/words`` when that file existed (Debian ``wamerican``), silently, so the same
seed drew other words (other ``text`` images, captions and answers) on a machine with the package.
The built-in list is the one the shipped captioner's recipe used as far as the history shows: the
captioner shipped (2026-11-22) before the project first names ``wamerican`` (the open-domain speech
text, 2026-11-28), and the machines it runs on and tests on have no ``/usr/share/dict``; the test
split under ``runs/`` and the tests were made with it too.
"""

from __future__ import annotations

# ~600 common, concrete English words of 3-8 letters.
BUILTIN_WORDS = tuple(sorted(set("""
able acid actor adult advice after again agent alarm album alert alley almond amber anchor angel
angle animal ankle answer apple april apron arch arena army arrow artist atlas attic autumn avenue
award baby back bacon badge bagel baker balcony ball bamboo banana band bank barber barn barrel
basket bath beach beacon bean bear beard beauty bed beef bell belt bench berry bicycle bird
biscuit black blade blanket block bloom blue board boat body bone bonus book boot border bottle
bottom bowl boxer brain branch brave bread breeze brick bridge bright brook broom brother brown
brush bubble bucket budget bugle bulb bundle bunny burger butter button cabin cable cactus cafe
cake camel camera camp canal candle candy canoe canvas canyon captain car card cargo carpet carrot
cart castle cattle cave cedar cellar cement center chain chair chalk charm cheese cherry chess
chest chicken child chimney choice cider cinema circle circus city class clay clean clerk cliff
climb clock cloud clover coach coast cobalt cocoa coconut coffee coin cold collar colony comet
comfort copper coral corn corner cotton couch country cousin cover cowboy crab cradle crane crayon
cream credit crew cricket crown crystal cup curtain cushion cycle dairy daisy dance danger dawn
deer delta dental desert desk dessert diamond diary diner dinner doctor dollar dolphin donkey door
dragon drama drawer dream dress drink driver drum duck dune eagle earth east echo eclipse elbow
elder empire engine entry equal escape evening exit fabric falcon family farm father feather fence
ferry festival field finger fire fish flag flame flash fleet flight flint flower flute focus
forest fork fossil fountain fox frame fresh friday friend frog frost fruit galaxy garage garden
garlic gate gem giant ginger glass globe glove gold golf goose grain grape grass gravel green
grill grocery guard guest guitar habit hall hammer harbor harvest hat hazel health heart hedge
helmet hero hill history hobby honey hood horizon horn horse hotel hour house hunter hybrid ice
icon igloo index ink island ivory jacket jaguar jam jar jazz jelly jewel journey judge juice
jungle kettle key kidney king kitchen kite kitten knife koala label ladder lake lamp lantern laser
lava lawn leaf lemon letter level library light lily lime linen lion liquid lizard lobby lobster
locker lodge logo lotus lucky lunar lunch magnet mail mango maple marble market meadow medal melon
memory menu mercury metal meteor milk mill mint mirror modern monkey month moon morning mosaic
motel motor mountain mouse muffin museum music napkin nature navy nectar needle nest network
night noble noodle north novel nurse oasis ocean office olive onion open opera orange orbit
orchard organ otter oven owl oxygen paddle palace palm panda paper parade park parrot party pasta
pastry path peach peanut pearl pencil pepper piano picnic pigeon pillow pilot pine pizza planet
plant plaza pocket poem polar pond pony poppy port potato pottery powder prince prism pumpkin
puppy purple puzzle quartz queen quiet quilt rabbit racket radar radio rain ranch raven razor
record reef relay rescue ribbon rice river road robin robot rocket rodeo roof room rose rover
royal ruby rugby ruler saddle safari safe sail salad salmon salt sand saturn sauce scarf school
science scooter screen sea season seed shadow shark shelf shell shield ship shirt shoe shop shore
signal silk silver singer sister skate sketch sky slate sleep slope smile snack snake snow soap
soccer socks sofa soil solar soup south space spark spice spider spoon spring square squid stable
stadium stage star station steam steel stone storm story stove straw stream street studio sugar
summer sun sunset supper surf swan sweater table tablet taco tailor talent tango taxi tea teacher
temple tennis tent thunder ticket tiger timber toast tomato tower town toy track tractor trail
train travel tree tribe trophy truck trumpet tulip tunnel turkey turtle twin umbrella uncle union
unit valley vanilla velvet violet violin visit voice volcano wagon walnut walrus wall water wave
wheat wheel whale willow window winter wizard wolf wonder wood world yacht yard yellow yogurt zebra
zero zone zoo
""".split())))

GROCERIES = ("MILK", "BREAD", "EGGS", "TEA", "RICE", "JAM", "SOAP", "FISH", "CAKE", "SOUP", "PASTA",
             "APPLES", "BEANS", "CHEESE", "BUTTER", "JUICE", "COFFEE", "SUGAR", "SALT", "FLOUR",
             "HONEY", "OIL", "PEAS", "CORN", "PLUMS", "NUTS", "YOGURT", "LEMONS", "ONIONS", "TOFU")

STREET_SUFFIXES = ("St", "Ave", "Rd", "Ln", "Way", "Blvd", "Dr")


def word_list() -> tuple[str, ...]:
    """Plain lower-case words of 3-8 letters: :data:`BUILTIN_WORDS` (never a system dictionary)."""
    return BUILTIN_WORDS
